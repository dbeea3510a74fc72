"""NeMo-RL's loss modes and what they mean for the patches: framework knowledge the core must not hold.

What each mode of ``ClippedPGLossFn`` divides a micro-batch's loss by (:data:`DENOMINATORS`),
and the settings that give zero-advantage rows a gradient (:func:`gradient_terms`); the loss
object carries them as attributes on every tag.
"""

from __future__ import annotations

from typing import Any

from grpo_patches.errors import OptionError
from grpo_patches.zero_advantage import GradientTerm

from . import FRAMEWORK

#: ``ClippedPGLossFn.loss_type`` (``LossType`` member name) -> what one micro-batch's loss is
#: divided by (:data:`grpo_patches.zero_advantage.DENOMINATORS`). Both divide by a count the
#: worker all-reduces over the whole global batch before micro-batching (``global_valid_toks``
#: / ``global_valid_seqs``): a number that does not depend on which rows a micro-batch holds.
DENOMINATORS: dict[str, str] = {
    "TOKEN_LEVEL": "fixed",  # masked_mean(..., global_normalization_factor=global_valid_toks)
    "SEQUENCE_LEVEL": "fixed",  # masked_mean(per-row token means, sample_mask, global_valid_seqs)
}


def loss_mode(loss_fn: Any) -> str:
    """The loss object's aggregation mode, e.g. ``"TOKEN_LEVEL"``."""
    mode = getattr(loss_fn, "loss_type", None)
    return str(getattr(mode, "name", mode))


def denominator(loss_fn: Any) -> str:
    """What the worker divides a micro-batch's loss by, for ``loss_fn``'s mode.

    :raises OptionError: a loss mode this adapter does not know.
    """
    mode = loss_mode(loss_fn)
    if mode not in DENOMINATORS:
        raise OptionError(f"unknown {FRAMEWORK.name} loss mode {mode!r}; valid ones are: {', '.join(DENOMINATORS)}")
    return DENOMINATORS[mode]


def gradient_terms(loss_fn: Any, *, moe: bool = False) -> list[GradientTerm]:
    """The loss object's settings that decide whether zero-advantage rows have a gradient.

    :param moe: the policy is a mixture of experts whose router statistics (aux loss, gate
        bias update) see every row of a micro-batch.
    """
    terms = [
        GradientTerm("loss_fn.reference_policy_kl_penalty", float(getattr(loss_fn, "reference_policy_kl_penalty", 0.0)),
                     "the KL penalty"),
        GradientTerm(
            "loss_fn.positive_example_nll_weight",
            float(getattr(loss_fn, "positive_example_nll_weight", 0.0) or 0.0),
            why="the positive-example NLL term is normalised by each micro-batch's own count of correct "
            "tokens, so dropping rows changes the other rows' weight",
        ),
    ]
    if moe:
        terms.append(GradientTerm(
            "policy model (mixture of experts)", 1.0,
            why="router statistics (aux loss, gate-bias update) are taken over every row of a micro-batch",
        ))
    return terms


def is_mixture_of_experts(model: Any) -> bool:
    """Whether ``model``'s config declares routed experts."""
    config = getattr(model, "config", None)
    for name in ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "num_moe_experts"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 1:
            return True
    return False
