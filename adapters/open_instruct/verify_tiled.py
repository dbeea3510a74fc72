"""Verify mode's check of the tiled log-probs: open-instruct's own dense computation on the same hidden states.

On a verified forward (:mod:`.verify`) the tiled forward's log-probs and entropies are compared
(relative L2 over the positions computed) with what ``forward_for_logprobs`` computes from full logits — open-instruct's own
``model_utils.log_softmax_and_gather`` and ``entropy_from_logits`` of ``(hidden @ weight.T + bias) /
temperature`` — and its backward with the dense backward of the same (given the same incoming
gradient): the two places where the tiled lm-head differs from open-instruct's code. The dense
``[tokens, vocab]`` logits exist on verified forwards only.
"""

from __future__ import annotations

from typing import Any

from grpo_patches import verify as core_verify

from .state import TiledForward
from .verify import judge


def _dense(hidden: Any, weight: Any, bias: Any, labels: Any, temperature: float, entropy: bool) -> tuple[Any, Any]:
    import torch.nn.functional as F
    from open_instruct import model_utils

    logits = F.linear(hidden, weight, bias) / temperature
    logps = model_utils.log_softmax_and_gather(logits, labels)
    return logps, (model_utils.entropy_from_logits(logits.detach()) if entropy else None)


def forward(tiled: TiledForward, hidden: Any, weight: Any, bias: Any, logps: Any, entropy: Any) -> tuple[Any, Any]:
    """The tiled ``(logps, entropy)`` (fp32, 0 outside ``tiled.mask``), or the dense ones if they differ and
    ``verify_action="disable"``."""
    import torch

    with torch.no_grad():
        dense, dense_entropy = _dense(hidden, weight, bias, tiled.labels, tiled.temperature, tiled.entropy_wanted)
        dense = torch.where(tiled.mask, dense.float(), torch.zeros_like(logps))
        measured = core_verify.rel_l2([logps[tiled.mask]], [dense[tiled.mask]])
        if dense_entropy is not None:
            dense_entropy = torch.where(tiled.mask, dense_entropy.float(), torch.zeros_like(entropy))
            measured = max(measured, core_verify.rel_l2([entropy[tiled.mask]], [dense_entropy[tiled.mask]]))
    verdict = judge(tiled.step, ["tiled_loss"], tiled.verify_group, "tiled_logprob_rel_diff", measured,
                    dtype=weight.dtype)
    if verdict.ok:
        return logps, entropy
    tiled.dense = True
    return dense, dense_entropy if dense_entropy is not None else entropy


def backward(tiled: TiledForward, hidden: Any, weight: Any, bias: Any, grad: Any, grads: list) -> list:
    """The tiled gradients ``[hidden, weight(, bias)]``, or the dense ones (``tiled.dense``, or a failing check)."""
    import torch

    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(True) for t in (hidden, weight, bias) if t is not None]
        dense, _ = _dense(*leaves[:2], leaves[2] if bias is not None else None, tiled.labels, tiled.temperature, False)
        wanted = torch.autograd.grad((dense.float() * grad.float()).sum(), leaves)
    if tiled.dense:
        return list(wanted)
    verdict = judge(tiled.step, ["tiled_loss"], tiled.verify_group, "tiled_grad_rel_diff",
                    core_verify.rel_l2(grads, wanted), dtype=weight.dtype)
    return grads if verdict.ok else list(wanted)
