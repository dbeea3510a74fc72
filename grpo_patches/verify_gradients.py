"""Verify mode's gradient comparison of one micro-batch, on :mod:`grpo_patches.verify`.

The judgement follows the precision the computation really has:

* fp32 / fp64: ``grad_rel_diff``, patched against unpatched, within :data:`~.verify.FP32_TOLERANCE`.
* half precision with an fp32 ``reference`` (the unpatched computation with autocast off: fp32
  weights under bf16 / fp16 autocast): ``grad_rel_diff`` is the patched gradient's distance from
  that reference and ``grad_noise_floor`` the unpatched half-precision gradient's own distance
  from it. A patched computation that rounds less than upstream (the tiled loss's fp32 head) is
  closer to the reference, never a difference; one that is wrong is far from it.
* half precision without one (bf16 weights): the reference is the unpatched gradient and the
  floor an equivalent unpatched ``repeat`` (the rows in another order): a computation that
  rounds exactly as upstream does.
* ``exact``: a configuration whose half-precision decisions are discontinuous (an entropy mask's
  quantile, a clip at its boundary) flips on rounding noise: the patched and the unpatched
  computation both in fp32, judged as fp32; the half-precision patched result is the one used.

Each computation's gradient is taken (:func:`~.verify.grads_of`, ``.grad`` untouched) before
the next runs; the adapter makes each start from the same random state and leave no trace.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from grpo_patches import verify as core
from grpo_patches import verify_fp32_head

if TYPE_CHECKING:  # pragma: no cover
    import torch

Loss = Callable[[], "torch.Tensor"]


@dataclass(frozen=True)
class GradientCheck:
    """What :func:`compare_gradients` concluded for one micro-batch.

    :ivar loss: hand it to the framework's own backward: its value is the chosen computation's
        loss and its backward accumulates exactly the chosen gradient.
    :ivar verdict: the comparison's :class:`~.verify.Verdict` (``ok=False``: the unpatched one is used).
    :ivar noise_floor: the unpatched gradient's distance from the reference, or from its repeat
        (half precision only); ``None`` without either.
    :ivar patched: whether the patched computation was kept.
    :ivar reference_floor: the unpatched gradient's distance from the ``head_reference``, when one ran.
    """

    loss: "torch.Tensor"
    verdict: "core.Verdict"
    noise_floor: float | None
    patched: bool
    reference_floor: float | None = None


def compare_gradients(framework: str, optimizations: Sequence[str], step: int, params: Sequence["torch.Tensor"],
                      patched: Loss, unpatched: Loss, repeat: Loss | None = None, dtype: Any = None,
                      group: Any = None, detail: str = "", reference: Loss | None = None,
                      exact: tuple[Loss, Loss] | None = None, head_reference: Loss | None = None) -> GradientCheck:
    """Compare one micro-batch's gradient, patched vs unpatched, and choose the one to accumulate.

    Each callable computes a scalar loss on the same inputs and weights (module docstring).

    :param repeat: an equivalent unpatched computation, the noise floor of a half ``dtype``
        without a ``reference`` (not run in fp32, nor when the user set ``verify_tolerance``).
    :param reference: the unpatched computation in fp32, for a half ``dtype`` (preferred to ``repeat``).
    :param exact: ``(patched, unpatched)`` in fp32 for a configuration whose half-precision
        decisions are discontinuous: the verdict is theirs; ``unpatched`` runs only on a mismatch.
    :param head_reference: without a ``reference``: the unpatched computation with only its lm-head
        in fp32 (:mod:`grpo_patches.verify_fp32_head`, for the tiled loss), measured from as a
        ``reference`` is, within :func:`grpo_patches.verify_fp32_head.tolerance` (``repeat`` kept);
        it returns ``None`` where the framework never called the head (no reference, same on every rank).

    The figure ``grad_rel_diff`` is judged by :func:`~.verify.check` (agreed over ``group``'s
    ranks; raises with ``verify_action="raise"``).

    :returns: the loss for the framework's backward (:func:`~.verify.as_loss` of the chosen
        gradient: the patched one within tolerance, else the unpatched one).
    """
    import torch

    loss_p = patched()
    grads_p = core.grads_of(loss_p, params)
    floor, loss_u, grads_u, head_floor = None, None, None, None
    if exact is not None:
        exact_p = core.grads_of(exact[0](), params)
        verdict = judge_gradients(framework, optimizations, step, exact_p, core.grads_of(exact[1](), params),
                                  dtype=torch.float32, group=group, detail=_fp32(detail))
    else:
        loss_u = unpatched()
        grads_u = core.grads_of(loss_u, params)
        against, limit = None, None
        if core.needs_noise_floor(framework, dtype):
            if reference is not None:
                against = core.grads_of(reference(), params)
                floor = core.noise_floor(grads_u, against, group)
            elif repeat is not None:
                floor = core.noise_floor(core.grads_of(repeat(), params), grads_u, group)
            head_loss = head_reference() if reference is None and head_reference is not None else None
            if head_loss is not None:
                against = core.grads_of(head_loss, params)
                head_floor = core.noise_floor(grads_u, against, group)
                limit = verify_fp32_head.tolerance(framework, dtype, head_floor, floor)
        verdict = judge_gradients(framework, optimizations, step, grads_p, grads_u, dtype=dtype, noise_floor=floor,
                                  group=group, detail=detail, reference=against, limit=limit)
    if verdict.ok:
        return GradientCheck(core.as_loss(loss_p, params, grads_p), verdict, floor, True, head_floor)
    if loss_u is None:
        loss_u = unpatched()
        grads_u = core.grads_of(loss_u, params)
    return GradientCheck(core.as_loss(loss_u, params, grads_u), verdict, floor, False, head_floor)


def judge_gradients(framework: str, optimizations: Sequence[str], step: int,
                    patched: Sequence["torch.Tensor | None"], unpatched: Sequence["torch.Tensor | None"],
                    dtype: Any = None, noise_floor: float | None = None, group: Any = None,
                    detail: str = "", reference: Sequence["torch.Tensor | None"] | None = None,
                    limit: float | None = None) -> "core.Verdict":
    """:func:`compare_gradients`' verdict on gradients an adapter took itself: ``grad_rel_diff``
    (:func:`~.verify.rel_l2`, patched against ``reference`` when given, else against unpatched)
    judged by :func:`~.verify.check` against :func:`~.verify.tolerance` (or ``limit``, when the
    adapter worked it out: :func:`grpo_patches.verify_fp32_head.tolerance`).

    For a framework whose own backward must produce them (NeMo-RL's FSDP2 worker: its
    gradients exist only as the reduce-scattered ``.grad`` of sharded parameters, which
    :func:`~.verify.grads_of` cannot reach); the adapter then leaves ``.grad`` as the chosen one
    alone would have left it."""
    measured = core.rel_l2(patched, reference if reference is not None else unpatched)
    if limit is None:
        limit = core.tolerance(framework, dtype, noise_floor, reference is not None)
    return core.check(framework, optimizations, step, "grad_rel_diff", measured, limit, group=group, detail=detail)


def _fp32(detail: str) -> str:
    return "; ".join(filter(None, ["judged in fp32 (the configuration's half-precision decisions are discontinuous)",
                                   detail]))
