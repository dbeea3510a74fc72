"""What verify mode measured, per framework, for ``status()`` (kept apart from
:mod:`grpo_patches.verify` so that the API reads it without importing the comparisons)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Record:
    steps: set = field(default_factory=set)
    checks: int = 0
    last: dict[str, float] = field(default_factory=dict)  # quantity -> the last agreed figure
    worst: dict[str, float] = field(default_factory=dict)  # quantity -> its largest figure so far
    failures: list[str] = field(default_factory=list)


_lock = threading.Lock()
_records: dict[str, _Record] = {}


def record(framework: str, step: int, quantity: str, measured: float, failure: str | None) -> None:
    """One comparison of verify step ``step`` (``failure``: its description when above tolerance)."""
    with _lock:
        entry = _records.setdefault(framework, _Record())
        entry.steps.add(step)
        entry.checks += 1
        entry.last[quantity] = measured
        entry.worst[quantity] = max(entry.worst.get(quantity, 0.0), measured)
        if failure is not None:
            entry.failures.append(failure)


def report(framework: str) -> dict[str, Any] | None:
    """What verification did so far, ``None`` when it never ran."""
    with _lock:
        entry = _records.get(framework)
        if entry is None:
            return None
        return {"steps_verified": len(entry.steps), "checks": entry.checks, "last": dict(entry.last),
                "worst": dict(entry.worst), "failures": list(entry.failures)}


def reset(framework: str | None = None) -> None:
    """Forget what verification recorded (of one framework, or all)."""
    with _lock:
        if framework is None:
            _records.clear()
        else:
            _records.pop(framework, None)
