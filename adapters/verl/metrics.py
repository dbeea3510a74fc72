"""grpo_patches' counters and metric renames in verl's own metrics dicts.

verl's actors return a metrics dict per update (legacy ``update_policy``; engine
``forward_backward_batch``'s ``metrics``) that the trainer reduces (lists: mean) and logs
to every backend. Counters go there under ``grpo_patches/`` and into ``status()`` totals.
"""

from __future__ import annotations

from typing import Any, Iterable, MutableMapping

from . import FRAMEWORK

PREFIX = "grpo_patches/"
#: The suffix of a metric computed over the rows the filter kept (``dropped_rows_metrics=False``).
KEPT_ROWS = "/kept_rows"
#: Counters logged in verl's metrics that are not work saved (``status()`` totals leave them out).
NOT_SAVINGS = ("padding_rows",)


def report(metrics: MutableMapping[str, Any] | None, **counts: float) -> None:
    """Add the counts of one update to ``status()`` totals and to ``metrics`` (``grpo_patches/<name>``)."""
    nonzero = {name: value for name, value in counts.items() if value and name not in NOT_SAVINGS}
    if nonzero:
        FRAMEWORK.report_savings(**nonzero)
    if metrics is not None:
        for name, value in counts.items():
            metrics[PREFIX + name] = float(value)


def rename_kept_rows(metrics: MutableMapping[str, Any], unchanged: Iterable[str]) -> None:
    """Rename every metric not in ``unchanged`` to ``<name>/kept_rows``: computed over kept rows only."""
    keep = set(unchanged)
    for name in [k for k in metrics if k not in keep and not k.startswith(PREFIX)]:
        metrics[name + KEPT_ROWS] = metrics.pop(name)


def gather_rows(t: Any, group: Any = None) -> Any:
    """All ranks' rows of ``t`` in rank order (ranks may hold different row counts after the filter):
    what a metric over the whole batch (``actor/entropy``) aggregates."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    sizes = [None] * world
    dist.all_gather_object(sizes, int(t.shape[0]), group=group)
    padded = torch.zeros((max(sizes), *t.shape[1:]), dtype=t.dtype)
    padded[: t.shape[0]] = t
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])
