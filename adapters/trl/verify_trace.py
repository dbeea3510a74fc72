"""What TRL's loss code leaves on the trainer, taken back after verify mode's extra computation.

A verify micro-step runs TRL's ``_compute_loss`` more than once (patched, unpatched, a
repeat). Each run appends to TRL's metric lists (``_metrics``), may reassign trainer
attributes (the adaptive entropy controller's window and coefficient) and adds to the
adapter's own counters. :class:`Trace` snapshots all three before the first run; after each
run :meth:`Trace.take` returns what the run left and puts the snapshot back, and
:meth:`Trace.apply` installs the state the chosen run left, so the trainer ends the micro-step
as after that run alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import state


@dataclass(frozen=True)
class Snapshot:
    """The trainer's loss-side state: metric lists (copies), attributes (by identity), counters."""

    metrics: dict[str, dict[str, list]]
    attributes: dict[str, Any]
    totals: dict


class Trace:
    """Snapshot / take back / apply the trainer's loss-side state (module docstring)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.start = self._snapshot()

    def _snapshot(self) -> Snapshot:
        lists = getattr(self.trainer, "_metrics", None) or {}
        metrics = {mode: {name: list(values) for name, values in bucket.items()} for mode, bucket in lists.items()}
        attributes = {name: value for name, value in vars(self.trainer).items() if name != "_metrics"}
        return Snapshot(metrics, attributes, dict(state.of(self.trainer).totals))

    def take(self) -> Snapshot:
        """What the run since the snapshot left; the trainer is put back to the snapshot."""
        after = self._snapshot()
        self.apply(self.start)
        return after

    def apply(self, snapshot: Snapshot) -> None:
        """Make the trainer's loss-side state ``snapshot`` (lists copied: a snapshot stays reusable)."""
        lists = getattr(self.trainer, "_metrics", None) or {}
        for mode, bucket in lists.items():
            bucket.clear()
            bucket.update({name: list(values) for name, values in snapshot.metrics.get(mode, {}).items()})
        current = vars(self.trainer)
        for name in [name for name in current if name != "_metrics" and name not in snapshot.attributes]:
            del current[name]
        for name, value in snapshot.attributes.items():
            if current.get(name) is not value:
                current[name] = value
        totals = state.of(self.trainer).totals
        totals.clear()
        totals.update(snapshot.totals)
