"""Verify mode: prove "changes nothing" on the user's own run, on chosen steps.

With ``verify_every=N`` an adapter, on the first optimizer step and every ``N``-th one after
it, also runs what the unpatched framework would have run for every optimization that changed
work on that step (same inputs, same weights), compares, and hands the figures to
:func:`check`:

* zero-advantage filter, tiled loss: the step's (or micro-batch's) gradient, both computed
  with :func:`grads_of` (``.grad`` untouched), compared by :func:`rel_l2`; the chosen one is
  accumulated with :func:`as_loss`;
* a skipped old-logprob or reference pass: the pass really runs and :func:`max_abs_diff`
  compares it with what the loss used (the reference pass: the loss with and without it);
* TRL's recompute decision: a rollout whose pass the rule skipped gets it computed.

:func:`check` agrees on the figures over the data-parallel ranks (one all-reduce, the
maximum), so every rank reaches the same verdict, records them for ``status()`` and returns
them as metrics named ``grpo_patches/verify/<quantity>`` for the framework's own logs. Above
the tolerance, ``verify_action="raise"`` raises :class:`~grpo_patches.errors.ExactnessError`;
``"disable"`` switches the optimizations off for the rest of the run (a warning, a note in
``status()``) and the verdict tells the adapter to use the unpatched result for this step.

A verify step must leave no trace besides its metrics: :func:`preserved_rng` restores the
random states the extra computation consumed, :func:`grads_of` does not touch ``.grad``.
torch is imported only by the functions that compute.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from grpo_patches import verify_log
from grpo_patches.errors import ExactnessError, GrpoPatchesWarning

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: Prefix of every verify metric in the framework's own logs.
METRIC_PREFIX = "grpo_patches/verify/"
#: ``verify_tolerance=None`` in fp32 / fp64: the largest relative difference accepted.
FP32_TOLERANCE = 1e-5
#: ``verify_tolerance=None`` in bf16 / fp16: accepted up to this many times the noise floor.
NOISE_FACTOR = 10.0
#: The noise floor is never taken below this fraction of the dtype's machine epsilon: a
#: re-batched repeat can be bitwise equal by chance, and 10 x 0 would flag any rounding.
_FLOOR_OF_EPS = 0.01


@dataclass(frozen=True)
class Verdict:
    """What :func:`check` concluded for one comparison.

    :ivar ok: ``True`` when the difference is within the tolerance; ``False`` (only with
        ``verify_action="disable"``) when the adapter must use the unpatched result.
    :ivar measured: the figure agreed over the ranks.
    :ivar tolerance: the tolerance it was held to.
    :ivar metrics: ``{"grpo_patches/verify/<quantity>": measured}`` for the framework's logs.
    :ivar reason: why the optimizations were switched off (``ok=False``), as ``status()`` says
        it; an adapter repeats it in its per-class notes. Empty when ``ok``.
    """

    ok: bool
    measured: float
    tolerance: float
    metrics: dict[str, float]
    reason: str = ""


def settings(framework: str) -> tuple[int | None, str, float | None]:
    """``(verify_every, verify_action, verify_tolerance)`` in force (``verify_every`` ``None``: off)."""
    from grpo_patches import api

    options = api.active_options(framework)
    if options is None:
        return None, "raise", None
    return options.verify_every, options.verify_action, options.verify_tolerance


def due(framework: str, step: int) -> bool:
    """Whether optimizer step ``step`` (0-based, as the adapter counts them) is verified."""
    every = settings(framework)[0]
    return every is not None and step >= 0 and step % every == 0


def tolerance(framework: str, dtype: "torch.dtype | str | None" = None, noise_floor: float | None = None) -> float:
    """The tolerance of a comparison computed in ``dtype``.

    ``verify_tolerance`` when the user set it; else :data:`FP32_TOLERANCE` for fp32 / fp64 and,
    for bf16 / fp16, :data:`NOISE_FACTOR` times ``noise_floor`` (the same unpatched computation
    repeated with the rows in another order, on the same step), never below a hundredth of the
    dtype's epsilon. Without a measured floor a half dtype uses its epsilon as the floor.
    """
    user = settings(framework)[2]
    if user is not None:
        return user
    eps = _half_eps(dtype)
    if eps is None:
        return FP32_TOLERANCE
    floor = eps if noise_floor is None or not math.isfinite(noise_floor) else max(noise_floor, _FLOOR_OF_EPS * eps)
    return NOISE_FACTOR * floor


def _half_eps(dtype: Any) -> float | None:
    name = str(dtype).replace("torch.", "") if dtype is not None else "float32"
    return {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}.get(name)


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
    if not terms:
        return value.detach()
    surrogate = sum(terms[1:], terms[0])
    return value.detach() + (surrogate - surrogate.detach()).to(value.dtype)


def check(framework: str, optimizations: Sequence[str], step: int, quantity: str, measured: float,
          limit: float, group: Any = None, detail: str = "") -> Verdict:
    """Judge one comparison of verify step ``step`` and act on it.

    :param optimizations: the option names whose work the comparison covers (an error names
        them; ``"disable"`` switches them all off).
    :param quantity: what was measured (``"grad_rel_diff"``, ``"old_logprob_max_abs_diff"``, ...);
        the metric is ``grpo_patches/verify/<quantity>``.
    :param measured: this rank's figure; the verdict uses the maximum over ``group``'s ranks.
    :param limit: the tolerance (:func:`tolerance`).
    :raises ExactnessError: above the tolerance with ``verify_action="raise"``.
    """
    from grpo_patches import api

    agreed = agree({quantity: measured}, group)[quantity]
    names = tuple(dict.fromkeys(optimizations))
    ok = agreed <= limit
    verify_log.record(framework, step, quantity, agreed,
                      None if ok else f"step {step}: {', '.join(names)}: {quantity} = {agreed:.3e} > {limit:.3e}")
    metrics = {METRIC_PREFIX + quantity: agreed}
    if ok:
        return Verdict(True, agreed, limit, metrics)
    action = settings(framework)[1]
    if action == "raise":
        raise ExactnessError(framework, names, step, quantity, agreed, limit, detail)
    reason = (f"switched off by verification at step {step}: {quantity} = {agreed:.3e} > tolerance {limit:.3e}"
              f"{f' ({detail})' if detail else ''}")
    for option in names:
        api.switch_off(framework, option, reason)
    warnings.warn(f"grpo_patches verify: {framework}: {', '.join(names)} {reason}; this step uses the unpatched "
                  "result and the run goes on without them", GrpoPatchesWarning, stacklevel=2)
    return Verdict(False, agreed, limit, metrics, reason)


@dataclass(frozen=True)
class GradientCheck:
    """What :func:`compare_gradients` concluded for one micro-batch.

    :ivar loss: hand it to the framework's own backward: its value is the chosen computation's
        loss and its backward accumulates exactly the chosen gradient.
    :ivar verdict: the comparison's :class:`Verdict` (``ok=False``: the unpatched one is used).
    :ivar noise_floor: the relative L2 between the unpatched gradient and its repeat (half
        precision only), ``None`` without a repeat.
    :ivar patched: whether the patched computation was kept.
    """

    loss: "torch.Tensor"
    verdict: Verdict
    noise_floor: float | None
    patched: bool


def compare_gradients(framework: str, optimizations: Sequence[str], step: int, params: Sequence["torch.Tensor"],
                      patched: Callable[[], "torch.Tensor"], unpatched: Callable[[], "torch.Tensor"],
                      repeat: Callable[[], "torch.Tensor"] | None = None, dtype: Any = None, group: Any = None,
                      detail: str = "") -> GradientCheck:
    """Compare one micro-batch's gradient, patched vs unpatched, and choose the one to accumulate.

    Each callable computes a scalar loss on the same inputs and weights; they run in the order
    ``patched``, ``unpatched``, ``repeat`` and each gradient is taken (:func:`grads_of`, ``.grad``
    untouched) before the next runs, so one graph is alive at a time. The adapter makes them
    start from the same random state and leave no other trace (:func:`rng_state`).
    ``repeat``: the unpatched computation with the rows in another order, for the noise floor
    of a half-precision ``dtype`` (:func:`tolerance`); not run in fp32.

    The figure is ``grad_rel_diff`` (:func:`rel_l2`, patched against unpatched), judged by
    :func:`check` (agreed over ``group``'s ranks; raises with ``verify_action="raise"``).

    :returns: the loss to hand to the framework's backward (:func:`as_loss` of the chosen
        gradient: the patched one within tolerance, else the unpatched one).
    """
    loss_p = patched()
    grads_p = grads_of(loss_p, params)
    loss_u = unpatched()
    grads_u = grads_of(loss_u, params)
    floor = None
    if repeat is not None and _half_eps(dtype) is not None:
        floor = rel_l2(grads_of(repeat(), params), grads_u)
    measured = rel_l2(grads_p, grads_u)
    verdict = check(framework, optimizations, step, "grad_rel_diff", measured,
                    tolerance(framework, dtype, floor), group=group, detail=detail)
    if verdict.ok:
        return GradientCheck(as_loss(loss_p, params, grads_p), verdict, floor, True)
    return GradientCheck(as_loss(loss_u, params, grads_u), verdict, floor, False)
