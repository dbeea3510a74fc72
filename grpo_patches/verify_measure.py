"""What verify mode measures with, framework-free (:mod:`grpo_patches.verify` re-exports it all).

* differences: :func:`rel_l2` (gradients), :func:`max_abs_diff` (log-probs), agreed over the
  data-parallel ranks by :func:`agree` (one all-reduce, the maximum);
* gradients without a trace: :func:`grads_of` (``.grad`` untouched) and :func:`as_loss` (a loss
  whose backward accumulates exactly a chosen gradient);
* random states: :func:`rng_state` / :func:`set_rng_state` / :func:`preserved_rng`;
* rows found again by content: :func:`match_rows` (a framework that shuffles and splits a
  rollout into micro-batches keeps no row index).

torch is imported only by the functions that compute.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch


def rel_l2(measured: Sequence["torch.Tensor | None"], reference: Sequence["torch.Tensor | None"]) -> float:
    """``||measured - reference|| / ||reference||`` over lists of tensors (``None`` counts as zeros),
    in float64. ``0.0`` when both are zero; ``inf`` when only the reference is."""
    import torch

    if len(measured) != len(reference):
        raise ValueError(f"rel_l2: {len(measured)} tensors against {len(reference)}")
    diff = torch.zeros((), dtype=torch.float64)
    norm = torch.zeros((), dtype=torch.float64)
    for a, b in zip(measured, reference):
        if a is None and b is None:
            continue
        a64 = _local(a).double() if a is not None else None
        b64 = _local(b).double() if b is not None else None
        if b64 is not None:
            norm = norm + b64.pow(2).sum().cpu()
        delta = a64 if b64 is None else (b64.neg() if a64 is None else a64 - b64)
        diff = diff + delta.pow(2).sum().cpu()
    diff, norm = diff.sqrt().item(), norm.sqrt().item()
    if not math.isfinite(diff):
        return math.inf
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


def max_abs_diff(measured: "torch.Tensor", reference: "torch.Tensor", mask: "torch.Tensor | None" = None) -> float:
    """The largest ``|measured - reference|`` where ``mask`` is set (everywhere without one);
    ``inf`` when a compared value is not finite (a NaN placeholder reaching the loss, say)."""
    import torch

    delta = (_local(measured).double() - _local(reference).double()).abs()
    if mask is not None:
        keep = _local(mask).bool()
        delta = delta[keep]
    if delta.numel() == 0:
        return 0.0
    if not bool(torch.isfinite(delta).all()):
        return math.inf
    return float(delta.max().item())


def _local(t: "torch.Tensor") -> "torch.Tensor":
    """A DTensor's full value (gradients of sharded parameters), else the tensor itself."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t.detach()


def agree(values: Mapping[str, float], group: Any = None) -> dict[str, float]:
    """The maximum of each figure over the ranks of ``group`` (one all-reduce; NaN counts as
    ``inf``), so that every rank reaches the same verdict. Without ``torch.distributed`` (or
    with one rank) the figures themselves."""
    cleaned = {k: (math.inf if not math.isfinite(v) else float(v)) for k, v in values.items()}
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return cleaned
    if not cleaned or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return cleaned
    import torch

    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    # inf does not survive every backend's max: send a large finite stand-in, map it back
    big = 1e300
    flat = torch.tensor([min(v, big) for v in cleaned.values()], dtype=torch.float64, device=device)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    return {k: (math.inf if v >= big else v) for k, v in zip(cleaned, flat.tolist())}


@dataclass(frozen=True)
class RngState:
    """The random states a verify step restores (:func:`rng_state`, :func:`set_rng_state`)."""

    cpu: Any
    cuda: Any
    python: Any
    numpy: Any


def rng_state() -> RngState:
    """The current random states: torch CPU and CUDA (when initialised), Python's ``random``,
    NumPy's global generator."""
    import random

    import torch

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        import numpy

        np_state = numpy.random.get_state()
    except ImportError:  # pragma: no cover
        np_state = None
    return RngState(torch.get_rng_state(), cuda, random.getstate(), np_state)


def set_rng_state(state: RngState) -> None:
    """Put back the random states :func:`rng_state` returned.

    An adapter runs the patched and the unpatched computation of a verify step from the same
    state, then sets the state the chosen one left: the next step draws what it would have
    drawn in a run of the chosen computation alone."""
    import random

    import torch

    torch.set_rng_state(state.cpu)
    if state.cuda is not None:
        torch.cuda.set_rng_state_all(state.cuda)
    random.setstate(state.python)
    if state.numpy is not None:
        import numpy

        numpy.random.set_state(state.numpy)


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Run the block and restore the random states it consumed (torch CPU and CUDA, Python's
    ``random``, NumPy's global generator): the step after a verify step draws what it would
    have drawn without verification."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


def match_rows(rows: Sequence["torch.Tensor"], among: Sequence["torch.Tensor"]) -> list[list[int]]:
    """For each row of ``rows``, the indices of the rows of ``among`` equal to it in every tensor.

    ``rows`` and ``among`` are parallel lists of ``[n, ...]`` and ``[N, ...]`` tensors (e.g. the
    prompt and completion ids and masks of a micro-batch, and of the rollout it was cut from).
    A framework that shuffles and splits a rollout into micro-batches keeps no row index; the
    content finds the rows again (identical rows have identical inputs, hence identical values
    of any pass computed on them). An empty list: the row is not among them."""
    import torch

    if len(rows) != len(among) or not rows:
        raise ValueError(f"match_rows: {len(rows)} tensors against {len(among)}")
    n, total = int(rows[0].size(0)), int(among[0].size(0))
    equal = torch.ones(n, total, dtype=torch.bool, device=rows[0].device)
    for mine, theirs in zip(rows, among):
        if mine.shape[1:] != theirs.shape[1:]:
            return [[] for _ in range(n)]
        a, b = mine.reshape(n, -1), theirs.to(mine.device).reshape(total, -1)
        for i in range(n):  # one row at a time: [N, width] at most, whatever n
            equal[i] &= (b == a[i]).all(dim=1)
    return [torch.nonzero(equal[i]).flatten().tolist() for i in range(n)]


def grads_of(loss: "torch.Tensor", params: Sequence["torch.Tensor"], retain_graph: bool = False) -> list:
    """``d loss / d params`` without touching ``.grad`` (``None`` for a parameter the loss does not use)."""
    import torch

    wanted = [p for p in params if p.requires_grad]
    grads = iter(torch.autograd.grad(loss, wanted, retain_graph=retain_graph, allow_unused=True))
    return [next(grads) if p.requires_grad else None for p in params]


def as_loss(value: "torch.Tensor", params: Sequence["torch.Tensor"], grads: Sequence["torch.Tensor | None"]) -> "torch.Tensor":
    """A scalar equal to ``value`` whose backward accumulates exactly ``grads`` into ``params``
    (through the framework's own backward: its loss scaling, its data-parallel hooks).

    The chosen gradient of a verify step reaches ``.grad`` as if that path had run alone:
    ``d/dp sum(p * g) = g``, and the value carries no gradient of its own."""
    terms = [(p * g.to(p.dtype)).sum() for p, g in zip(params, grads) if g is not None and p.requires_grad]
    if not terms:  # no gradient at all (a micro-step with nothing to train): still a loss to backward
        return value.detach().requires_grad_(value.requires_grad)
    surrogate = sum(terms[1:], terms[0])
    return value.detach() + (surrogate - surrogate.detach()).to(value.dtype)
