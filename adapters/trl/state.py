"""Everything the TRL adapter keeps: per-trainer state, and what the wrappers of one call hand each other.

One optimizer step of ``GRPOTrainer`` (GA micro-steps), in run order (records: :data:`.PATCHES`):

1. ``training_step`` (each micro-step): :func:`.accumulation_window.training_step` counts it in
   :attr:`TrainerState.window`.
2. ``_generate_and_score_completions`` (a micro-step that generates; training only): a rollout,
   one :class:`RolloutCall` (:data:`ROLLOUT`).

   * :func:`.verify_rollout.generate_and_score_completions` (verify mode, outermost) enters it
     with an ``observer`` when a verify step consumes the rollout, after dropping the last
     rollout's :attr:`TrainerState.verify_rollout`;
   * :func:`.old_logprobs.generate_and_score_completions` joins it (or enters it): sets
     ``decision`` (the recompute decision; option ``recompute``), arms ``deferred`` when the
     rollout gets a pass (deferred to the rows the filter keeps: :mod:`.old_logprob_rows`), then
     runs TRL's method with its modulo rule made to give the decision, or to run TRL's pass
     where the observer needs it (:attr:`RolloutCall.observed_pass`);
   * TRL's old-logprob call reaches :mod:`.policy_forward`'s wrapper, which hands it to
     :meth:`RolloutCall.answer`: the observer runs TRL's pass over every row (a pass run for
     verification only), or the deferral answers with a placeholder and keeps TRL's arguments;
   * back in :mod:`.old_logprobs`: :func:`.old_logprob_rows.complete` runs the pass on the kept
     rows (the observer compares them with TRL's pass over every row first), the reference pass
     is observed; back in :mod:`.verify_rollout`: a pass run for verification only is taken out
     of the rollout and kept in :attr:`TrainerState.verify_rollout` for the micro-steps.
3. ``compute_loss`` (each micro-step): one :class:`LossCall` (:data:`LOSS`).

   * :func:`.verify.compute_loss` (verify mode, outermost, on a verify step) enters it with
     ``verifying`` for the patched computation, then runs TRL's unpatched one inside
     ``FRAMEWORK.unpatched()`` (every other record passes through) and compares;
   * :func:`.tiled.compute_loss` joins it (or enters it) and sets ``tiled``;
   * :func:`.zero_advantage.compute_loss` (on ``_compute_loss``) joins it and sets ``keep``,
     ``dropped_forward``, ``fill_logps``, ``always_split`` (reading ``verifying``);
   * TRL's policy forward reaches :mod:`.policy_forward`'s wrapper, which answers it from those
     fields and writes ``used``, ``logps``, ``entropies``, ``forward_rows``, ``row_inputs``,
     ``padding_tokens_skipped``, ``tiled_loss``; the loss wrappers read them back afterwards
     (counters, ``<name>/kept_rows`` metrics, the tiled gradient; verify: what ran, which
     log-probs the loss used).

Per-trainer state (:class:`TrainerState`, ``FRAMEWORK.state_of``) lives as long as the trainer
and is cleared by ``grpo_patches.disable``; a per-call context only during its call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from grpo_patches.call_context import CallSlot

from . import FRAMEWORK

#: ``tiled(trainer, method, arguments, rows) -> (loss, logps, entropies, aux_loss)``: the tiled loss
#: of ``rows`` (a LongTensor), ``arguments`` being TRL's log-prob ``method``'s for those rows.
TiledRows = Callable[[Any, Callable[..., Any], Mapping[str, Any], Any], tuple]


@dataclass
class Window:
    """Micro-steps finished in the current accumulation window of one ``train()`` call."""

    state: Any  # the HF TrainerState the count belongs to (a new train()/resume makes a new one)
    global_step: int  # optimizer steps done when the window began
    done: int


@dataclass
class StoredRollout:
    """TRL's old-logprob pass over every row of the latest rollout (verify steps only).

    :ivar rows: the rollout's :data:`.verify_rollout.ROW_KEYS` tensors (to find a micro-batch's rows).
    :ivar old: ``[B, T]`` the pass as unpatched TRL computes it.
    :ivar skipped: the recompute decision skipped TRL's pass (the loss uses current log-probs).
    :ivar noise_floor: half precision: the pass repeated with the rows re-batched (max abs diff).
    """

    rows: list
    old: Any
    skipped: bool
    noise_floor: float | None


@dataclass
class TrainerState:
    """What the adapter remembers about one ``GRPOTrainer``.

    :ivar window: the running accumulation window (:mod:`.accumulation_window`).
    :ivar last_decision: the recompute decision of the latest rollout (:mod:`.old_logprobs`).
    :ivar recompute_on: whether the exact recompute runs for this trainer (decided once).
    :ivar filter_on: whether the zero-advantage filter runs for this trainer (decided once).
    :ivar objective: the trainer's loss (:class:`.loss_modes.Objective`), once the filter decided.
    :ivar tiled_on: whether the tiled loss runs for this trainer (decided once).
    :ivar pack_on: whether the kept rows of a window are packed (:mod:`.packing`; decided once).
    :ivar segment: the micro-batches packing dealt for the running window (:class:`.packing.Segment`).
    :ivar totals: running totals of the counters written to TRL's metrics, by (mode, name).
    :ivar verify_rollout: the latest rollout's old-logprob pass over every row, kept when a
        verify step consumes it (:mod:`.verify_rollout`).
    """

    window: Window | None = None
    last_decision: Any = None
    recompute_on: bool | None = None
    filter_on: bool | None = None
    objective: Any = None
    tiled_on: bool | None = None
    pack_on: bool | None = None
    segment: Any = None
    totals: dict[tuple[str, str], float] = field(default_factory=dict)
    verify_rollout: StoredRollout | None = None


def of(trainer: Any) -> TrainerState:
    """The TRL adapter's state for ``trainer`` (created on first use)."""
    return FRAMEWORK.state_of(trainer, TrainerState)


@dataclass
class RolloutCall:
    """One training ``_generate_and_score_completions`` call (module docstring, step 2).

    :ivar decision: the recompute decision (:class:`.old_logprobs.RecomputeDecision`; ``None``:
        TRL's own rule decides).
    :ivar deferred: the old-logprob pass deferred to the kept rows
        (:class:`.old_logprob_rows.Deferred`; ``None``: not deferred).
    :ivar observer: verify mode's look at TRL's pass over every row
        (:class:`.verify_rollout.Observer`; ``None``: no verify step consumes the rollout).
    """

    decision: Any = None
    deferred: Any = None
    observer: Any = None

    @property
    def observed_pass(self) -> bool:
        """TRL's pass runs for verification only: the decision skipped a pass TRL's rule runs, in a
        rollout verify mode observes (the observer answers TRL's call; the values leave the rollout)."""
        decision = self.decision
        return self.observer is not None and decision is not None and decision.upstream and not decision.compute

    def answer(self, trainer: Any, method: Callable[..., Any], arguments: Mapping[str, Any],
               arity: int) -> tuple | None:
        """TRL's old-logprob call in this rollout (``method``'s arguments by name; it returns
        ``arity`` values): the answer, or ``None`` for TRL's own forward."""
        interceptor = self.observer if self.observed_pass else self.deferred
        return None if interceptor is None else interceptor.answer(trainer, method, arguments, arity)


#: The rollout being generated (entered by the outermost ``_generate_and_score_completions`` record).
ROLLOUT: CallSlot[RolloutCall] = CallSlot("trl.rollout")


@dataclass
class LossCall:
    """What the loss wrappers of one micro-step ask of its policy forward (module docstring, step 3).

    :ivar verifying: verify mode's patched computation: a placeholder the loss would read stays
        NaN (the gradient comparison catches it, and the patched result is then never used)
        instead of raising.
    :ivar keep: rows to run with gradients (``None``: all rows).
    :ivar dropped_forward: the dropped rows get a no-grad forward for their true values
        (``dropped_rows_metrics=True``: :mod:`.dropped_rows`); otherwise none, and their values
        are filled in.
    :ivar fill_logps: ``[B, T]`` log-probs filled in for the dropped rows (their old log-probs,
        so the ratio is exactly 1); ``None``: zeros (TRL then uses the detached current ones).
    :ivar always_split: run the no-grad forward even with nothing dropped (one dummy row), so
        every data-parallel rank runs the same number of forwards (ZeRO-3 / FSDP gather
        parameters collectively inside each forward).
    :ivar tiled: computes the tiled loss of a row subset (``None``: TRL's own forward).
    :ivar used: set once the policy forward was answered (only the first one of the call is).
    :ivar tiled_loss: the tiled loss of the kept rows (normalised by the whole micro-batch).
    :ivar logps: the ``[B, T]`` log-probs TRL received (verify mode compares a skipped
        old-logprob pass with them: the loss uses them detached instead).
    :ivar entropies: the ``[B, T]`` entropies TRL received.
    :ivar forward_rows: rows that went through a forward.
    :ivar row_inputs: each row's multimodal model inputs (recorded once per call).
    :ivar padding_tokens_skipped: token positions of the kept rows not computed because no kept
        row uses their column (:mod:`.trim`).
    :ivar packed: the micro-batch was dealt by ``pack_kept_rows`` (:mod:`.packing`; verify mode
        then names that optimization too).
    """

    verifying: bool = False
    keep: Any = None
    dropped_forward: bool = True
    fill_logps: Any = None
    always_split: bool = False
    tiled: TiledRows | None = None
    used: bool = False
    tiled_loss: Any = None
    logps: Any = None
    entropies: Any = None
    forward_rows: int = 0
    row_inputs: Any = None
    padding_tokens_skipped: int = 0
    packed: bool = False


#: The micro-step's loss call (entered by the outermost ``compute_loss`` / ``_compute_loss`` record).
LOSS: CallSlot[LossCall] = CallSlot("trl.loss")
