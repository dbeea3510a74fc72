"""Verify mode, rollout side: TRL's old-logprob pass over every row of a rollout a verify step consumes.

Two optimizations change TRL's old-logprob pass (``_generate_and_score_completions``):

* the recompute decision (option ``recompute``, :mod:`.old_logprobs`) skips it for a rollout
  TRL's own rule would compute it for: the loss then uses the detached current log-probs;
* the deferred pass (:mod:`.deferred_pass`, part of ``zero_advantage_filter``) computes it only
  for the rows the filter keeps; the other rows hold a NaN placeholder.

When a rollout's micro-steps fall on a verify step (:func:`wanted`), TRL's pass also runs over
every row, with TRL's own method and arguments, no gradients and no trace on the random state
(:func:`full_pass`): for a skipped pass, TRL is made to run its own call (:class:`Capture`),
whose values are taken out of the rollout again. The result is kept as a
:class:`StoredRollout`:

* a deferred pass is compared at once, kept rows against the full pass
  (:func:`check_deferred`, ``grpo_patches/verify/old_logprob_max_abs_diff``);
* a skipped pass is compared in each micro-step, with the log-probs the loss used
  (:func:`check_skipped`, by :mod:`.verify`);
* the unpatched computation of a verify micro-step reads it as TRL would (:func:`upstream_inputs`),
  and a ``"disable"`` verdict puts it into TRL's buffered micro-batches (:func:`unpatch_buffer`),
  so the rest of the rollout runs as unpatched.

TRL shuffles a rollout's rows and splits them into micro-batches without keeping an index: a
micro-batch's rows are found again by their prompt and completion (:func:`grpo_patches.verify.match_rows`).

A pass TRL's rule does not run (an aligned schedule) is no saving of ours, and a pass the
decision adds (where TRL's rule goes stale) is what TRL should have run: neither is verified.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from grpo_patches import api, verify

from . import logprob_pass, metrics, placeholders, state
from .loss_types import loss_mask
from .row_subsets import is_multimodal

#: The tensors a row is recognised by in a micro-batch (TRL's rollout keys).
ROW_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")


@dataclass
class StoredRollout:
    """TRL's old-logprob pass over every row of the latest rollout (verify steps only).

    :ivar rows: the rollout's :data:`ROW_KEYS` tensors (to find a micro-batch's rows).
    :ivar old: ``[B, T]`` the pass as unpatched TRL computes it.
    :ivar skipped: the recompute decision skipped TRL's pass (the loss uses current log-probs).
    :ivar noise_floor: half precision: the pass repeated with the rows re-batched (max abs diff).
    """

    rows: list
    old: Any
    skipped: bool
    noise_floor: float | None


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


def wanted(trainer: Any) -> bool:
    """Whether a verify step consumes the rollout generated now: its ``steps_per_generation *
    num_iterations`` micro-steps span at most that many optimizer steps from this one."""
    if verify.settings("trl")[0] is None:
        return False
    step = int(trainer.state.global_step)
    span = int(trainer.args.steps_per_generation) * int(trainer.num_iterations)
    return any(verify.due("trl", s) for s in range(step, step + span))


def full_pass(trainer: Any, method: Callable[..., Any], arguments: Mapping[str, Any]) -> tuple[tuple, float | None]:
    """TRL's old-logprob pass over every row (``method``'s whole output) and, in half precision,
    its noise floor: the same pass with the rows in reverse order and half the chunk size, so
    that every row is computed in another batch (max abs diff over the completion tokens).
    The random state is left as it was (dropout draws)."""
    import torch

    with verify.preserved_rng():
        output = logprob_pass.run(trainer, method, arguments)
        floor = None
        if is_half(trainer) and not is_multimodal(arguments):
            values = output[0]
            rows = int(values.size(0))
            order = torch.arange(rows - 1, -1, -1, device=values.device)
            chunk = max(1, int(arguments.get("batch_size") or rows) // 2)
            again = logprob_pass.run(trainer, method, {**arguments, "batch_size": chunk}, order)[0].flip(0)
            floor = verify.max_abs_diff(again, values, arguments["attention_mask"][:, -values.size(1):])
    return output, floor


def store(trainer: Any, output: Mapping[str, Any], old: Any, skipped: bool, floor: float | None) -> StoredRollout:
    """Keep the full pass of the rollout ``output`` for the micro-steps that consume it."""
    stored = StoredRollout([output[key] for key in ROW_KEYS], old, skipped, floor)
    state.of(trainer).verify_rollout = stored
    return stored


# -- the skipped pass, run for verification only ----------------------------------------------


@dataclass
class Capture:
    """Answers TRL's old-logprob call in a rollout whose pass the recompute decision skipped,
    made to run only for verification: TRL's own call, over every row, with no trace on the
    random state (:func:`full_pass`). The values are taken out of the rollout afterwards."""

    output: tuple | None = None
    noise_floor: float | None = None

    def answer(self, trainer: Any, method: Callable[..., Any], arguments: Mapping[str, Any], arity: int) -> tuple | None:
        """Asked by the routing wrapper for a log-prob call outside a loss call (``None``: not ours)."""
        import torch

        if self.output is not None or torch.is_grad_enabled() or arguments.get("model") is not trainer.model:
            return None
        self.output, self.noise_floor = full_pass(trainer, method, arguments)
        return self.output


def force_pass(trainer: Any, upstream: bool, compute: bool) -> bool:
    """Whether this rollout's pass runs for verification only: the decision skipped a pass
    TRL's rule runs (``upstream and not compute``) and a verify step consumes the rollout."""
    return upstream and not compute and wanted(trainer)


@contextmanager
def capturing(trainer: Any, force: bool) -> Iterator[Capture | None]:
    """For one ``_generate_and_score_completions`` call: arm a :class:`Capture` (``force``).
    The deferral is off meanwhile: the forced pass is compared, never used."""
    if not force:
        yield None
        return
    own = state.of(trainer)
    deferred, own.deferred = own.deferred, None
    own.verify_capture = Capture()
    try:
        yield own.verify_capture
    finally:
        own.verify_capture, own.deferred = None, deferred


# -- comparisons -------------------------------------------------------------------------------


def _tolerance(trainer: Any, floor: float | None) -> float:
    return verify.tolerance("trl", compute_dtype(trainer), floor)


def note_switched_off(trainer: Any, verdict: verify.Verdict, names: list[str]) -> None:
    """After ``"disable"``: the trainer class's notes say so too (they said "on" until now)."""
    for name in names:
        api.note("trl", name, f"off: {verdict.reason}", owner=trainer)


def check_deferred(trainer: Any, arguments: Mapping[str, Any], output: Mapping[str, Any], old: Any, keep: Any) -> Any:
    """Compare the deferred pass's kept rows with TRL's pass over every row; keep the latter.

    :returns: the old log-probs the rollout goes on with: ``old`` (the deferred pass, NaN
        placeholders in the other rows), or TRL's full pass when ``"disable"`` switched the
        filter off."""
    full_output, floor = full_pass(trainer, trainer._get_per_token_logps_and_entropies, arguments)
    full = full_output[0].to(old.dtype)
    keep = keep.to(old.device)
    measured = verify.max_abs_diff(old[keep], full[keep], loss_mask(output)[keep])
    verdict = verify.check("trl", ["zero_advantage_filter"], int(trainer.state.global_step), "old_logprob_max_abs_diff",
                           measured, _tolerance(trainer, floor),
                           detail="the old-logprob pass deferred to the kept rows against TRL's pass over every row")
    metrics.record_verify(trainer, verdict.metrics)
    store(trainer, output, full, skipped=False, floor=floor)
    if verdict.ok:
        return old
    note_switched_off(trainer, verdict, ["zero_advantage_filter"])
    return full


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
    return verify.check("trl", ["recompute"], step, "old_logprob_max_abs_diff", measured,
                        _tolerance(trainer, match.rollout.noise_floor),
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
