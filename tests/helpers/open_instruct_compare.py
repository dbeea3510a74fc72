"""Comparing two runs of open-instruct's learners (patched against unpatched), for the compat tests.

A run is a :class:`grpo_patches_testing.open_instruct_cpu.Result`. The DeepSpeed learner's gradients
live inside DeepSpeed's partitioned optimizer: its runs are compared through DeepSpeed's grad norm
after every optimizer step and, with SGD, the weights after every optimizer step (their differences
are the per-step gradients times the learning rate) and at the end. The OLMo-core learner's runs
record each optimizer step's gradient itself.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any, Callable

#: The package-level options of every optimization, as a user turns them all on.
ALL_ON = dict(logprob_skip=True, recompute=True, zero_advantage_filter=True)
ALL_ON_TILED = dict(ALL_ON, tiled_loss=True)


def rel(a: Any, b: Any) -> float:
    """``|a - b| / |b|`` (0 when both are 0)."""
    import torch

    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    scale = float(b.norm())
    diff = float((a - b).norm())
    return diff / scale if scale else diff


def weights_rel(a: dict, b: dict) -> float:
    """The largest relative difference of any parameter."""
    return max(rel(a[name], b[name]) for name in b)


def distance(patched: Any, unpatched: Any) -> float:
    """The largest relative difference between two runs: the largest of :func:`gaps` (NaN if one is NaN: a
    run that ended in NaN proves nothing either way)."""
    values = list(gaps(patched, unpatched).values())
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def planted_fault_gap(fault: Any, patched: Callable[[], Any], unpatched: Any, record_property: Callable,
                      name: str) -> float:
    """:func:`distance` of the patched run made under ``fault`` (a context manager planting it) from
    the unpatched run, recorded as ``name``."""
    with fault:
        gap = distance(patched(), unpatched)
    record_property(name, gap)
    return gap


def gaps(patched: Any, unpatched: Any) -> dict[str, float]:
    """Each relative difference between two runs, by name: ``grad_norm <s>`` per optimizer step,
    ``update <s>`` per-step updates (SGD snapshots, where recorded: from the second step), ``gradient <s>``
    recorded per-step gradients (each step's over all parameters together), ``weights`` the final weights
    (the largest over the parameters).

    A step whose unpatched gradient is zero in exact arithmetic (its norm under :data:`ZERO_STEP` of the
    run's largest: e.g. every ratio clipped in a later epoch) holds only rounding noise in both runs: it
    is compared on the scale of the run's largest step, not relative to its own noise."""
    assert len(patched.grad_norms) == len(unpatched.grad_norms), (patched.grad_norms, unpatched.grad_norms)
    out = {f"grad_norm {s + 1}": gap for s, gap in enumerate(_steps_rel(
        [(float(p), float(u)) for p, u in zip(patched.grad_norms, unpatched.grad_norms)]))}
    updates = [(_flat([b[1][n] - b[0][n] for n in sorted(a[1])]), _flat([a[1][n] - a[0][n] for n in sorted(a[1])]))
               for b, a in zip(_pairs(patched.snapshots), _pairs(unpatched.snapshots))]
    out.update({f"update {s + 2}": gap for s, gap in enumerate(_steps_rel(updates))})
    gradients = [(_flat([p[n] for n in sorted(u)]), _flat([u[n] for n in sorted(u)]))
                 for p, u in zip(patched.gradients, unpatched.gradients)]
    out.update({f"gradient {s + 1}": gap for s, gap in enumerate(_steps_rel(gradients))})
    out["weights"] = weights_rel(patched.weights, unpatched.weights)
    return out


#: A step at or under this fraction of the run's largest (norm) is a zero gradient's rounding noise.
ZERO_STEP = 1e-9


def _flat(tensors: list) -> Any:
    import torch

    return torch.cat([torch.as_tensor(t, dtype=torch.float64).flatten() for t in tensors])


def _steps_rel(pairs: list) -> list[float]:
    """``|ours - theirs| / |theirs|`` per step ``(ours, theirs)``; a noise step's (above) over the largest
    ``|theirs|`` instead."""
    import torch

    if not pairs:
        return []
    norms = [float(torch.as_tensor(t, dtype=torch.float64).norm()) for _, t in pairs]
    scale = max(norms)
    return [rel(o, t) if n > ZERO_STEP * scale else
            float((torch.as_tensor(o, dtype=torch.float64) - torch.as_tensor(t, dtype=torch.float64)).norm())
            / (scale or 1.0) for (o, t), n in zip(pairs, norms)]


def _pairs(snapshots: list) -> list:
    return list(zip(snapshots, snapshots[1:]))


def counts(result: Any) -> dict[str, int]:
    return {"ref_forwards": result.ref_forwards, "old_logprob_forwards": result.old_logprob_forwards,
            "policy_forwards": result.policy_forwards, "full_logits": result.full_logits,
            "optimizer_steps": len(result.grad_norms)}


def cached_runs(train: Callable[[Any], Any], runs: dict[str, Any]) -> Callable[[str], Any]:
    """``get(name)``: ``train(runs[name])``, run once (a module-scoped fixture shares it between tests)."""
    done: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in done:
            done[name] = train(runs[name])
        return done[name]

    return get


def dropping_a_useful_micro_batch(real_plan: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """The filter's planted fault: ``real_plan`` (``zero_advantage.plan``) that also drops a micro-batch with a
    gradient, in every epoch (so that no loss reads its skipped pre-pass), one that is not its group's last
    backward (DeepSpeed's accumulation boundary stays where the real plan put it)."""

    def wrong(learner: Any, step: Any) -> Any:
        plan = real_plan(learner, step)
        n = len(plan.useful)
        victim = next(i for i in range(n)
                      if plan.useful[i] and plan.runs[i] and not plan.last_backward[i])
        for s in range(victim, len(plan.runs), n):
            plan.runs[s] = False
        return plan

    return wrong


@contextlib.contextmanager
def cold_tiled(role: str | None = None) -> Iterator[None]:
    """The planted tiled fault: the tiled log-probs at temperature 1 whatever open-instruct asks (in the
    forwards of ``role``'s model only: ``"policy"`` or ``"reference"``)."""
    from grpo_patches.adapters.open_instruct import tiled_logprobs
    from grpo_patches.adapters.open_instruct.state import FORWARD

    real = tiled_logprobs.token_stats

    def cold(h: Any, w: Any, b: Any, labels: Any, mask: Any, temperature: float, tile: Any) -> Any:
        wrong = role is None or FORWARD.current().role == role
        return real(h, w, b, labels, mask, 1.0 if wrong else temperature, tile)

    tiled_logprobs.token_stats = cold
    try:
        yield
    finally:
        tiled_logprobs.token_stats = real


@contextlib.contextmanager
def stale_old_logprobs() -> Iterator[None]:
    """The recompute decision's planted fault: no micro-batch gets its pre-pass, and the guard takes every
    placeholder for one consumed before the first optimizer step (so it becomes the current log-probs, also
    after the weights moved)."""
    from grpo_patches.adapters.open_instruct import old_logprobs, placeholders

    real_needed, real_resolve = old_logprobs.needed, placeholders.resolve_old_logprob

    def wrong(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        step = placeholders._holder(args[0][args[1]], args[1])
        if step is None:
            return real_resolve(wrapped, instance, args, kwargs)
        saved, step.current.s = step.current.s, 0  # "before the first optimizer step", for the guard only
        try:
            return real_resolve(wrapped, instance, args, kwargs)
        finally:
            step.current.s = saved  # DeepSpeed's accumulation boundary still reads the true micro-step

    old_logprobs.needed = lambda step: [False] * step.n
    placeholders.resolve_old_logprob = wrong
    try:
        yield
    finally:
        old_logprobs.needed, placeholders.resolve_old_logprob = real_needed, real_resolve
