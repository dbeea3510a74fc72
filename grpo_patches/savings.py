"""Savings counters: what each framework's patches avoided, for status() and metrics."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Mapping

_lock = threading.Lock()
_totals: dict[str, dict[str, float]] = defaultdict(dict)


def report(framework: str, **savings: float) -> None:
    """Report work saved through the ``grpo_report_savings`` hook (all observers see it)."""
    from grpo_patches.plugins import hook

    hook().grpo_report_savings(framework=framework, savings=savings)


def add_to_totals(framework: str, savings: Mapping[str, float]) -> None:
    """Default observer: accumulate into the per-framework totals."""
    with _lock:
        bucket = _totals[framework]
        for name, value in savings.items():
            bucket[name] = bucket.get(name, 0) + value


def totals(framework: str) -> dict[str, float]:
    """A copy of the totals reported so far for ``framework``."""
    with _lock:
        return dict(_totals.get(framework, {}))


def reset(framework: str | None = None) -> None:
    """Forget the totals (of one framework, or all)."""
    with _lock:
        if framework is None:
            _totals.clear()
        else:
            _totals.pop(framework, None)
