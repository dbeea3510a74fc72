"""What the tiled lm-head loss reproduces of ``ClippedPGLossFn`` and the DTensor worker.

The tiled loss computes the clipped policy-gradient objective (``-A * min-clip(ratio)``, dual
clip, token- or sequence-level aggregation with the global counts) from hidden states and the
lm-head weight. Settings that add other terms or weights are not reproduced: with
``tiled_loss="auto"`` the worker keeps NeMo-RL's own loss then (the reason goes to
``status()``), with ``True`` they are an error.
"""

from __future__ import annotations

from typing import Any

from .loss_modes import DENOMINATORS, loss_mode

#: Model config attributes of logit transforms the tiled loss does not apply.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier",
                    "logits_scaling")
#: Loss settings (attribute, what it adds) that must be off.
_LOSS_FLAGS = (
    ("use_importance_sampling_correction", "importance-sampling weights"),
    ("sequence_level_importance_ratios", "sequence-level ratios (GSPO)"),
    ("disable_ppo_ratio", "the REINFORCE objective"),
    ("use_cispo", "the CISPO objective"),
)


def unsupported_loss_settings(loss_fn: Any) -> list[str]:
    """The loss object's settings the tiled loss does not reproduce (empty: it reproduces it)."""
    problems = []
    if loss_mode(loss_fn) not in DENOMINATORS:
        problems.append(f"loss_type={loss_mode(loss_fn)}")
    kl = float(getattr(loss_fn, "reference_policy_kl_penalty", 0.0) or 0.0)
    if kl != 0.0:
        problems.append(f"loss_fn.reference_policy_kl_penalty={kl} (the KL term)")
    for name, what in _LOSS_FLAGS:
        if getattr(loss_fn, name, False):
            problems.append(f"loss_fn.{name}=True ({what})")
    nll = float(getattr(loss_fn, "positive_example_nll_weight", 0.0) or 0.0)
    if nll != 0.0:
        problems.append(f"loss_fn.positive_example_nll_weight={nll} (the NLL term)")
    return problems


def unsupported_worker_settings(worker: Any, post_processor: Any, sampling_params: Any) -> list[str]:
    """The worker's settings the tiled path does not handle (empty: it handles them)."""
    problems = []
    if getattr(worker, "tp_size", 1) != 1:
        problems.append(f"tensor parallel size {worker.tp_size} (the lm-head output is vocab-sharded)")
    if getattr(post_processor, "cp_size", 1) != 1:
        problems.append(f"context parallel size {post_processor.cp_size}")
    if getattr(post_processor, "enable_seq_packing", False):
        problems.append("sequence packing (the loss is called per packed sequence)")
    for name in ("top_k", "top_p"):
        value = getattr(sampling_params, name, None)
        if value is not None and not (name == "top_p" and value == 1.0) and not (name == "top_k" and value <= 0):
            problems.append(f"{name}={value} (logits are re-filtered over the whole vocabulary)")
    model = getattr(worker, "model", None)
    head = getattr(model, "lm_head", None)
    if head is None or getattr(head, "weight", None) is None:
        problems.append("a model without an lm_head weight")
    config = getattr(model, "config", None)
    for name in LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value is not None and not (name == "logit_scale" and value == 1.0):
            problems.append(f"model config {name}={value} (a logit transform)")
    return problems


def not_reproduced(problems: list[str]) -> str:
    """The reason the tiled loss is off (or refused) for these settings, for ``refuse_or_note``."""
    return "the tiled loss does not reproduce NeMo-RL's loss with " + "; ".join(problems)
