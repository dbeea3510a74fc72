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
random states the extra computation consumed (:func:`rng_state` / :func:`set_rng_state` let an
adapter leave the state the chosen computation left), :func:`grads_of` does not touch ``.grad``.
The gradient comparison of one micro-batch every adapter runs is
:func:`grpo_patches.verify_gradients.compare_gradients`, built on this module.
The measuring functions live in :mod:`grpo_patches.verify_measure` and are re-exported here.
torch is imported only by the functions that compute.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from grpo_patches import verify_log
from grpo_patches.errors import ExactnessError, GrpoPatchesWarning
from grpo_patches.verify_measure import (  # noqa: F401  (verify mode's API, in one namespace)
    RngState,
    agree,
    as_loss,
    grads_of,
    match_rows,
    max_abs_diff,
    preserved_rng,
    rel_l2,
    rng_state,
    set_rng_state,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: Prefix of every verify metric in the framework's own logs.
METRIC_PREFIX = "grpo_patches/verify/"
#: ``verify_tolerance=None`` in fp32 / fp64: the largest relative difference accepted.
FP32_TOLERANCE = 1e-5
#: ``verify_tolerance=None`` in bf16 / fp16: accepted up to this many times the noise floor.
NOISE_FACTOR = 10.0
#: ``verify_tolerance=None`` in bf16 / fp16 against an fp32 reference: the patched gradient may be
#: this many times as far from the reference as the unpatched half-precision one. Measured (TRL,
#: tiny Qwen2, bf16 autocast): correct code 0.85-1.0x (the tiled loss's fp32 head: closer than
#: TRL's bf16 one; the filter: the same rounding), a tiled head weight 1 % off 2.2-2.4x, a
#: temperature 2 % off 4.0-4.3x, a dropped useful row 115x.
REFERENCE_FACTOR = 2.0
#: The half-precision noise floor of a gradient comparison, logged next to it.
NOISE_METRIC = METRIC_PREFIX + "grad_noise_floor"
#: The noise floor is never taken below this fraction of the dtype's machine epsilon: a
#: re-batched repeat can be bitwise equal by its layout (NeMo-RL's tiny Qwen2 in bf16 with one
#: non-zero-advantage row per micro-batch: 0.0) while an optimization's own correct rounding
#: reaches a quarter to a half of it (there 1.9e-3; verl's engine 3.8e-3): 10 x 0 would flag it.
_FLOOR_OF_EPS = 0.1


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


def tolerance(framework: str, dtype: "torch.dtype | str | None" = None, noise_floor: float | None = None,
              reference: bool = False) -> float:
    """The tolerance of a comparison computed in ``dtype``.

    ``verify_tolerance`` when the user set it; else :data:`FP32_TOLERANCE` for fp32 / fp64 and,
    for bf16 / fp16, a factor times ``noise_floor``, never below a tenth of the dtype's epsilon:
    :data:`REFERENCE_FACTOR` when the floor is the unpatched result's distance from an fp32
    ``reference`` (:mod:`grpo_patches.verify_gradients`), else :data:`NOISE_FACTOR` (the floor:
    the same unpatched computation repeated in another order, on the same step). Without a
    measured floor a half dtype uses its epsilon as the floor.
    """
    user = settings(framework)[2]
    if user is not None:
        return user
    eps = _half_eps(dtype)
    if eps is None:
        return FP32_TOLERANCE
    floor = eps if noise_floor is None or not math.isfinite(noise_floor) else max(noise_floor, _FLOOR_OF_EPS * eps)
    return (REFERENCE_FACTOR if reference else NOISE_FACTOR) * floor


def _half_eps(dtype: Any) -> float | None:
    name = str(dtype).replace("torch.", "") if dtype is not None else "float32"
    return {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}.get(name)


def needs_noise_floor(framework: str, dtype: Any) -> bool:
    """Whether a gradient comparison in ``dtype`` needs a measured noise floor: a half dtype
    and no ``verify_tolerance`` set by the user (then the repeat would only cost time)."""
    return _half_eps(dtype) is not None and settings(framework)[2] is None


def noise_floor(repeated: Sequence["torch.Tensor | None"], unpatched: Sequence["torch.Tensor | None"],
                group: Any = None) -> float:
    """The noise floor: :func:`rel_l2` of an equivalent unpatched computation's gradient (the
    same rows re-batched or in another order) against the unpatched one, the maximum over
    ``group``'s ranks, so that every rank holds the comparison to the same tolerance."""
    return agree({"noise_floor": rel_l2(repeated, unpatched)}, group)["noise_floor"]


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


