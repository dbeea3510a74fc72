"""Everything the verl adapter remembers about one framework object: one object, cleared on disable."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grpo_patches import instance_state


@dataclass
class ActorState:
    """Per-actor state (a legacy ``DataParallelPPOActor`` or an engine ``FSDPEngine``).

    :ivar filter_mode: the zero-advantage filter's mode for this actor, decided once:
        ``None`` (off), ``"pack"`` (dropped rows cost no forward) or ``"nograd"`` (dropped
        rows get a no-grad forward so every metric stays verl's: ``dropped_rows_metrics=True``).
    :ivar decided: ``filter_mode`` was decided.
    :ivar totals: running totals of the counters reported in verl's metrics.
    :ivar tiled: the tiled lm-head loss runs for this actor (decided once: ``tiled_decided``).
    :ivar optimizer_steps: the training updates (optimizer steps) seen so far, 0-based as verify
        mode counts them (:mod:`.verify`; counted only with ``verify_every`` set).
    """

    filter_mode: str | None = None
    decided: bool = False
    tiled: bool = False
    tiled_decided: bool = False
    totals: dict[str, float] = field(default_factory=dict)
    optimizer_steps: int = 0


def of(obj: Any) -> ActorState:
    """The verl adapter's state for ``obj`` (created on first use)."""
    return instance_state.state_of(obj, "verl", ActorState)
