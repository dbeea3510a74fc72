"""The half-precision reference of the tiled lm-head loss where the framework's weights cannot be
switched to fp32 for one recomputation (verl's engine, NeMo-RL's DTensor worker: FSDP2 casts
each parameter to its ``mixed_precision`` dtype when it gathers it, and has no public way to
gather one computation in fp32; half-precision weights anywhere: TRL, verl's legacy actor).

The tiled loss computes only the output head differently from upstream: the logits, in fp32
tiles, from the same half-precision hidden states and lm-head weight, where upstream rounds
``[tokens, vocab]`` logits to bf16 / fp16 and computes its log-softmax from them. So the
reference is upstream's own computation with only that matmul in fp32 (:func:`fp32_head`):
the backbone rounds as in both, the head as the tiled loss does. A correct tiled loss sits
next to it; upstream's half-precision gradient lies its own rounding away from it (the floor
:data:`~.verify.REFERENCE_FACTOR` scales); a wrong one is far from it. It never replaces the
re-batched repeat: rows an optimization moves between micro-batches round differently in the
backbone too, which only the repeat measures, so the tolerance is the larger of the two
(:func:`tolerance`). Where there is no repeat (verl's legacy actor), the patched computation runs
once more with the tiled loss stepping aside for the framework's fp32 head (``tiled_aside``): the
rows lie alike, so the tiled loss alone is judged against that, within 2x the head's own rounding.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

from grpo_patches import verify as core
from grpo_patches.call_args import bind
from grpo_patches.call_context import CallSlot

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: The unpatched half-precision gradient's distance from the fp32-head reference, logged next to
#: ``grad_rel_diff`` (which is then the patched gradient's distance from that reference).
REFERENCE_METRIC = core.METRIC_PREFIX + "grad_reference_floor"


def output_head(model: Any) -> Any:
    """The model's output projection (``get_output_embeddings()``, else ``lm_head``; through a
    DDP / FSDP1 wrapper's ``module``), or ``None``."""
    while model is not None:
        getter = getattr(model, "get_output_embeddings", None)
        head = getter() if callable(getter) else getattr(model, "lm_head", None)
        if head is not None:
            return head
        model = getattr(model, "module", None) or getattr(model, "_fsdp_wrapped_module", None)
    return None


class HeadCalls:
    """How many times the head ran in fp32: 0 means the framework never called it (another
    kernel took the lm-head weight itself), so the run is no reference. ``tiled_aside``: the
    patched computation runs, its tiled loss stepping aside for the framework's head (:func:`tiled_aside`)."""

    def __init__(self, tiled_aside: bool = False) -> None:
        self.count = 0
        self.tiled_aside = tiled_aside


#: The fp32-head reference computation running in this context (its count), else ``None``.
REFERENCE: CallSlot[HeadCalls] = CallSlot("verify.fp32_head")


def tiled_aside() -> bool:
    """Whether the tiled loss steps aside here: the patched computation runs as the reference of
    the tiled loss alone (every other optimization on, the framework's head in fp32)."""
    calls = REFERENCE.current()
    return calls is not None and calls.tiled_aside


@contextmanager
def fp32_head(model: Any, tiled_aside: bool = False) -> Iterator[HeadCalls]:
    """For the duration, ``model``'s output head computes its logits in fp32 (autocast off) from
    the half-precision hidden state and weight it is given (the unsharded weight: FSDP's hooks
    fire as usual around the instance-level ``forward``); its gradients flow back in their dtypes.

    A framework whose fused kernel takes the lm-head weight itself (verl's ``FusedLinearForPPO``)
    has a verify record there that computes in fp32 while :data:`REFERENCE` is entered (:func:`kernel_call`).
    ``tiled_aside``: the block runs the patched computation, whose tiled loss steps aside
    (:func:`tiled_aside`): the reference of the tiled loss alone, in the layout the other
    optimizations give the rows."""
    import torch.nn.functional as F

    head = output_head(model)
    with REFERENCE.entered(HeadCalls(tiled_aside)) as calls:
        if head is None or "forward" in vars(head):  # none, or another forward swapped in already
            yield calls
            return

        def forward(hidden: "torch.Tensor") -> "torch.Tensor":
            calls.count += 1
            bias = getattr(head, "bias", None)
            with full_precision(hidden):
                return F.linear(hidden.float(), head.weight.float(), None if bias is None else bias.float())

        head.forward = forward  # an instance attribute over the class's method
        try:
            yield calls
        finally:
            del head.forward


def fp32(*tensors: "torch.Tensor") -> tuple["torch.Tensor", ...] | None:
    """Within the reference (:data:`REFERENCE` entered): ``tensors`` in fp32, the call counted;
    call the kernel with them under :func:`full_precision`. Outside it: ``None``."""
    calls = REFERENCE.current()
    if calls is None:
        return None
    calls.count += 1
    return tuple(t.float() for t in tensors)


def kernel_call(wrapped: Callable[..., Any], args: tuple, kwargs: dict, *names: str) -> Any:
    """A fused kernel's call (a verify record's wrapper): within the reference with the arguments
    ``names`` (the hidden state, the head's weight, its bias) in fp32 (``None`` stays), autocast
    off, the call counted; everywhere else as called."""
    if REFERENCE.current() is None:
        return wrapped(*args, **kwargs)
    call = bind(wrapped, args, kwargs)
    present = [name for name in names if call.get(name) is not None]
    values = dict(zip(present, fp32(*(call[name] for name in present))))
    with full_precision(values[present[0]]):
        return call.call(wrapped, **values)


@contextmanager
def full_precision(like: "torch.Tensor") -> Iterator[None]:
    """Autocast off on ``like``'s device type."""
    import torch

    with torch.autocast(like.device.type, enabled=False):
        yield


def tolerance(framework: str, dtype: Any, reference_floor: float, repeat_floor: float | None) -> float:
    """The tolerance of a gradient measured against the fp32-head reference: :data:`~.verify.REFERENCE_FACTOR`
    times upstream's distance from it, or the tolerance the comparison has without the reference
    (:data:`~.verify.NOISE_FACTOR` times the re-batched ``repeat_floor``; without one, the dtype's
    epsilon) when that is larger (module docstring); ``verify_tolerance`` when the user set it."""
    return max(core.tolerance(framework, dtype, reference_floor, reference=True),
               core.tolerance(framework, dtype, repeat_floor))
