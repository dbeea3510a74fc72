"""Verify mode's check of the tiled log-probs: open-instruct's own dense computation on the same hidden states.

On a verified forward (:mod:`.verify`) the tiled forward's log-probs and entropies are compared
(relative L2 over the positions computed) with what ``forward_for_logprobs`` computes from full logits — open-instruct's own
``model_utils.log_softmax_and_gather`` and ``entropy_from_logits`` of ``(hidden @ weight.T + bias) /
temperature`` — and its backward with the dense backward of the same (given the same incoming
gradient): the two places where the tiled lm-head differs from open-instruct's code. The dense
``[tokens, vocab]`` logits exist on verified forwards only.

Judged against the precision each computation really has (:mod:`grpo_patches.verify_fp32_head`'s
rule, here on the head alone): the reference is that dense computation in fp32. With fp32 weights
it is open-instruct's own, held to the fp32 tolerance. With bf16 / fp16 weights open-instruct rounds
its logits to that dtype, and the tiled lm-head (fp32 tiles) does not: the tiled figures are their
distance from the fp32 reference, within 2x open-instruct's own half-precision distance from it
(``grpo_patches/verify/tiled_logprob_reference_floor`` / ``tiled_grad_reference_floor``), so
rounding less than open-instruct never counts as a difference. On a failing check with
``"disable"`` open-instruct's own (half-precision) result is used.
"""

from __future__ import annotations

from typing import Any

from grpo_patches import verify as core_verify

from . import FRAMEWORK
from .state import TiledForward
from .verify import judge


def _dense(hidden: Any, weight: Any, bias: Any, labels: Any, temperature: float, entropy: bool) -> tuple[Any, Any]:
    import torch.nn.functional as F
    from open_instruct import model_utils

    logits = F.linear(hidden, weight, bias) / temperature
    logps = model_utils.log_softmax_and_gather(logits, labels)
    return logps, (model_utils.entropy_from_logits(logits.detach()) if entropy else None)


def _half(weight: Any) -> bool:
    import torch

    return weight.dtype in (torch.bfloat16, torch.float16)


def _fp32(*tensors: Any) -> list:
    return [None if t is None else t.float() for t in tensors]


def _limit(tiled: TiledForward, quantity: str, own: list, reference: list, weight: Any) -> float:
    """The tolerance of a figure measured from the fp32 reference: open-instruct's own half-precision
    distance from it (logged as ``<quantity>_reference_floor``) times :data:`~grpo_patches.verify.REFERENCE_FACTOR`;
    the fp32 tolerance with fp32 weights."""
    if not _half(weight):
        return core_verify.tolerance(FRAMEWORK.name, weight.dtype)
    floor = core_verify.rel_l2(own, reference)
    metrics = tiled.step.verify_metrics
    key = f"{core_verify.METRIC_PREFIX}{quantity}_reference_floor"
    metrics[key] = max(metrics.get(key, floor), floor)
    return core_verify.tolerance(FRAMEWORK.name, weight.dtype, floor, reference=True)


def forward(tiled: TiledForward, hidden: Any, weight: Any, bias: Any, logps: Any, entropy: Any) -> tuple[Any, Any]:
    """The tiled ``(logps, entropy)`` (fp32, 0 outside ``tiled.mask``), or open-instruct's dense ones if
    they differ and ``verify_action="disable"``."""
    import torch

    def masked(values: Any, like: Any) -> Any:
        return None if values is None else torch.where(tiled.mask, values.float(), torch.zeros_like(like))

    with torch.no_grad():
        own = _dense(hidden, weight, bias, tiled.labels, tiled.temperature, tiled.entropy_wanted)
        exact = _dense(*_fp32(hidden, weight, bias), tiled.labels, tiled.temperature, tiled.entropy_wanted) \
            if _half(weight) else own
        dense, dense_entropy = masked(own[0], logps), masked(own[1], entropy) if entropy is not None else None
        ref, ref_entropy = masked(exact[0], logps), masked(exact[1], entropy) if entropy is not None else None
        pairs = [(logps, dense, ref)] + ([(entropy, dense_entropy, ref_entropy)] if dense_entropy is not None else [])
        figures = [(core_verify.rel_l2([got[tiled.mask]], [r[tiled.mask]]),
                    _limit(tiled, "tiled_logprob", [d[tiled.mask]], [r[tiled.mask]], weight)) for got, d, r in pairs]
        measured, limit = max(figures, key=lambda figure: figure[0] / figure[1])  # the farther of the two
    verdict = judge(tiled.step, ["tiled_loss"], tiled.verify_group, "tiled_logprob_rel_diff", measured,
                    dtype=weight.dtype, limit=limit)
    if verdict.ok:
        return logps, entropy
    tiled.dense = True
    return dense, dense_entropy if dense_entropy is not None else entropy


def backward(tiled: TiledForward, hidden: Any, weight: Any, bias: Any, grad: Any, grads: list) -> list:
    """The tiled gradients ``[hidden, weight(, bias)]``, or open-instruct's dense ones (``tiled.dense``, or a
    failing check)."""
    import torch

    def dense_grads(precise: bool) -> list:
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (hidden, weight, bias) if t is not None]
            inputs = _fp32(*leaves) if precise else leaves
            logps, _ = _dense(*inputs[:2], inputs[2] if bias is not None else None, tiled.labels, tiled.temperature,
                              False)
            return list(torch.autograd.grad((logps.float() * grad.float()).sum(), leaves))

    wanted = dense_grads(False)
    if tiled.dense:
        return wanted
    exact = dense_grads(True) if _half(weight) else wanted
    verdict = judge(tiled.step, ["tiled_loss"], tiled.verify_group, "tiled_grad_rel_diff",
                    core_verify.rel_l2(grads, exact), dtype=weight.dtype,
                    limit=_limit(tiled, "tiled_grad", wanted, exact, weight))
    return grads if verdict.ok else wanted
