"""Everything the TRL adapter remembers about one ``GRPOTrainer``: one object, cleared on disable."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grpo_patches import instance_state


@dataclass
class TrainerState:
    """Per-trainer state (see :mod:`grpo_patches.instance_state`).

    :ivar window: micro-steps done in the current accumulation window (:mod:`.accumulation_window`).
    :ivar last_decision: the recompute decision of the latest rollout (:mod:`.old_logprobs`).
    :ivar filter_on: whether the zero-advantage filter runs for this trainer (decided once).
    :ivar objective: the trainer's loss (:class:`.loss_types.Objective`), once the filter decided.
    :ivar deferred: the old-logprob pass deferred to the kept rows during one rollout
        (:class:`.deferred_pass.Deferred`: it answers TRL's log-prob call with a placeholder).
    :ivar tiled_on: whether the tiled loss runs for this trainer (decided once).
    :ivar recompute_on: whether the exact recompute runs for this trainer (decided once).
    :ivar loss_call: what the loss wrappers ask of the policy forward inside one
        ``_compute_loss`` call (:mod:`.policy_forward`).
    :ivar totals: running totals of the counters written to TRL's metrics, by (mode, name).
    :ivar unpatched: set while verify mode runs the unpatched computation of a micro-step
        (:mod:`.verify`): the loss wrappers and the policy-forward routing pass straight through.
    :ivar verifying: set while verify mode runs the patched computation of a micro-step: a
        placeholder the loss would read is left NaN (the gradient comparison catches it, and
        the patched result is then never used) instead of raising.
    :ivar verify_capture: armed while a generation call runs the old-logprob pass only for
        verification (:class:`.verify_rollout.Capture`).
    :ivar verify_rollout: the latest rollout's old-logprob pass over every row, kept when a
        verify step consumes it (:class:`.verify_rollout.StoredRollout`).
    """

    window: Any = None
    last_decision: Any = None
    filter_on: bool | None = None
    objective: Any = None
    deferred: Any = None
    tiled_on: bool | None = None
    recompute_on: bool | None = None
    loss_call: Any = None
    totals: dict[tuple[str, str], float] = field(default_factory=dict)
    unpatched: bool = False
    verifying: bool = False
    verify_capture: Any = None
    verify_rollout: Any = None


def of(trainer: Any) -> TrainerState:
    """The TRL adapter's state for ``trainer`` (created on first use)."""
    return instance_state.state_of(trainer, "trl", TrainerState)
