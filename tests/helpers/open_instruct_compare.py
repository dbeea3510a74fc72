"""Comparing two runs of open-instruct's learners (patched against unpatched), for the compat tests.

A run is a :class:`grpo_patches_testing.open_instruct_cpu.Result`. The DeepSpeed learner's gradients
live inside DeepSpeed's partitioned optimizer: its runs are compared through DeepSpeed's grad norm
after every optimizer step and, with SGD, the weights after every optimizer step (their differences
are the per-step gradients times the learning rate) and at the end. The OLMo-core learner's runs
record each optimizer step's gradient itself.
"""

from __future__ import annotations

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
    """The largest relative difference between two runs: grad norms per optimizer step, per-step updates
    (SGD snapshots, where recorded), recorded per-step gradients, final weights."""
    assert len(patched.grad_norms) == len(unpatched.grad_norms), (patched.grad_norms, unpatched.grad_norms)
    worst = max(rel(p, u) for p, u in zip(patched.grad_norms, unpatched.grad_norms))
    for before, after in zip(_pairs(patched.snapshots), _pairs(unpatched.snapshots)):
        worst = max(worst, max(rel(before[1][n] - before[0][n], after[1][n] - after[0][n]) for n in after[1]))
    for p, u in zip(patched.gradients, unpatched.gradients):
        worst = max(worst, max(rel(p[n], u[n]) for n in u))
    return max(worst, weights_rel(patched.weights, unpatched.weights))


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
