"""Verify mode: a micro-batch's rows in the rollout pass :mod:`.verify_rollout` kept, and what is read from it.

TRL shuffles a rollout's rows and splits them into micro-batches without keeping an index: a
micro-batch's rows are found again by their prompt and completion (:func:`find`,
:func:`grpo_patches.verify.match_rows`). Then, in a verify micro-step (:mod:`.verify`):

* a skipped pass is compared with the log-probs the loss used (:func:`check_skipped`,
  ``grpo_patches/verify/old_logprob_max_abs_diff``);
* the unpatched computation reads the kept pass as unpatched TRL would (:func:`upstream_inputs`);
* a ``"disable"`` verdict puts it into TRL's buffered micro-batches (:func:`unpatch_buffer`),
  so the rest of the rollout runs as unpatched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from grpo_patches import verify

from . import FRAMEWORK, placeholders, state
from .loss_modes import loss_mask
from .state import StoredRollout

#: The tensors a row is recognised by in a micro-batch (TRL's rollout keys).
ROW_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")


@dataclass
class Match:
    """A micro-batch's rows in the stored rollout: per row, the rollout rows with its inputs."""

    rollout: StoredRollout
    candidates: list[list[int]]

    def first(self) -> list[int] | None:
        """One rollout row per micro-batch row (``None`` when a row was not found)."""
        if not all(self.candidates):
            return None
        return [found[0] for found in self.candidates]


def compute_dtype(trainer: Any) -> Any:
    """The precision TRL computes in: bf16 / fp16 autocast, else the model's parameter dtype."""
    import torch

    if getattr(trainer.args, "bf16", False):
        return torch.bfloat16
    if getattr(trainer.args, "fp16", False):
        return torch.float16
    return next(trainer.model.parameters()).dtype


def is_half(trainer: Any) -> bool:
    import torch

    return compute_dtype(trainer) in (torch.bfloat16, torch.float16)


def tolerance(trainer: Any, floor: float | None) -> float:
    """The tolerance of an old-logprob comparison in TRL's precision (``floor``: its noise floor)."""
    return verify.tolerance(FRAMEWORK.name, compute_dtype(trainer), floor)


def note_switched_off(trainer: Any, verdict: verify.Verdict, names: list[str]) -> None:
    """After ``"disable"``: the trainer class's notes say so too (they said "on" until now)."""
    for name in names:
        FRAMEWORK.note(name, f"off: {verdict.reason}", owner=trainer)


def find(trainer: Any, inputs: Mapping[str, Any]) -> Match | None:
    """The stored rollout's rows of micro-batch ``inputs`` (``None``: nothing stored)."""
    stored = state.of(trainer).verify_rollout
    if stored is None:
        return None
    if any(inputs.get(key) is None for key in ROW_KEYS):
        return Match(stored, [[] for _ in range(int(inputs["advantages"].size(0)))])
    return Match(stored, verify.match_rows([inputs[key] for key in ROW_KEYS], stored.rows))


def upstream_inputs(inputs: Mapping[str, Any], match: Match | None) -> Mapping[str, Any]:
    """Micro-batch ``inputs`` as unpatched TRL has them: TRL's full pass as old log-probs
    where the patches skipped or deferred it."""
    rows = match.first() if match is not None else None
    if rows is None:
        return placeholders.guard(inputs)  # nothing to substitute: a placeholder read is an error
    import torch

    old = match.rollout.old
    index = torch.tensor(rows, device=old.device)
    return {**inputs, placeholders.KEY: old.index_select(0, index).to(inputs["completion_ids"].device)}


def check_skipped(trainer: Any, step: int, match: Match, inputs: Mapping[str, Any], used: Any, rows: Any) -> verify.Verdict:
    """Compare a skipped pass with the log-probs the loss used instead (the detached current
    ones): per micro-batch row that had a forward (``rows``), over its completion tokens, the
    closest rollout row with its inputs; the largest difference."""
    mask = loss_mask(inputs)
    measured = 0.0 if used is not None else math.inf
    old = match.rollout.old
    for row in ([] if used is None else rows.tolist()):
        found = match.candidates[row]
        differences = [verify.max_abs_diff(used[row], old[other].to(used.device), mask[row]) for other in found]
        measured = max(measured, min(differences, default=math.inf))
    return verify.check(FRAMEWORK.name, ["recompute"], step, "old_logprob_max_abs_diff", measured,
                        tolerance(trainer, match.rollout.noise_floor),
                        detail="a skipped old-logprob pass against the current log-probs the loss used instead")


def unpatch_buffer(trainer: Any) -> None:
    """After ``"disable"``: TRL's full pass into every buffered micro-batch of the stored
    rollout, so that its remaining micro-steps read what unpatched TRL reads."""
    stored = state.of(trainer).verify_rollout
    for batch in getattr(trainer, "_buffered_inputs", None) or ():
        match = find(trainer, batch) if stored is not None else None
        rows = match.first() if match is not None else None
        if rows is not None:
            batch[placeholders.KEY] = upstream_inputs(batch, match)[placeholders.KEY]
