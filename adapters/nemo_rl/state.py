"""What the NeMo-RL adapter remembers: per-instance state, and the per-call contexts its wrappers share.

Per instance (``FRAMEWORK.state_of``, cleared by ``disable()``): :class:`PolicyState`,
:class:`WorkerState`. Per call, each in its :class:`~grpo_patches.call_context.CallSlot`:
:class:`SetupCall`, :class:`LoopCall`, :class:`TrainCall`, :class:`TiledMicrobatch`. The driver
hands the workers plain attributes on the loss object NeMo-RL pickles to them for one
``Policy.train`` call (:data:`PREV_IS_CURRENT`, :data:`VERIFY_PREV`, :data:`VERIFY_REFERENCE`);
they hand back ``grpo_patches/...`` keys in the metrics ``train`` returns.

One step, in run order (module:wrapper of the attribute; ``>`` enters, ``.field`` reads or writes):

Driver, ``grpo.setup`` (once): ``driver_setup:setup`` > :data:`SETUP` (``.reference``: the
reference decision); ``reference:init`` (``Policy.__init__``, v0.5 / v0.6) reads ``.reference``.

Driver, ``grpo_train``: ``old_logprobs:grpo_train`` > :data:`LOOP` for the whole loop
(``.policy``, ``.loss_fn``, ``.config``). Each step:

1. the prev-logprob pass: ``old_logprobs:skip_prev_logprobs`` (v0.7.0+) or ``:get_logprobs``
   (v0.5 / v0.6) decide and write ``.prev``, ``.placeholders``; v0.6.0's
   ``:compute_and_apply_seq_logprob_error_masking`` reads ``.prev``;
2. ``policy_train:train`` (``Policy.train``) reads ``.prev``, ``.steps`` (verify mode's step) and
   runs a late or deferred pass (:mod:`.old_logprob_rows`) with ``FRAMEWORK.unpatched()``, puts
   the flags on the loss object, writes ``.unlogged`` from the metrics the workers returned;
3. ``honest_logs:*`` (``Logger``) read ``.placeholders``, ``.unlogged``, ``.prev_is_zero``.

Worker, one ``train()`` call (v0.6.0+, DTensor and Megatron workers alike):

1. ``worker_train:process_global_batch`` (its first global batch) > :data:`TRAIN`: the worker,
   the loss object, the frame; decides ``.filter_on``, ``.tiled_on``. Ray ships ``train`` by
   value, so no wrapper encloses the call: it is left at ``aggregate_training_statistics``
   (step 6), or by the next call's start when it raised (:func:`current_train` never returns a
   call whose ``train`` frame is gone);
2. per global batch, ``get_microbatch_iterator``: ``verify:get_microbatch_iterator`` (outermost)
   writes ``.remake`` / ``.rebatch``; ``zero_advantage_v060:`` (``zero_advantage_megatron:``)
   ``get_microbatch_iterator`` reads ``.filter_on``, ``.loss_fn``, writes ``.current`` (the
   global batch's :class:`GlobalBatchFilter`) and the counters;
3. ``verify:automodel_forward_backward`` reads ``.filter_on`` / ``.tiled_on`` and the loss
   flags; on a verify step it writes ``.prev_diff`` / ``.reference_diff`` around the patched
   run, runs NeMo-RL's unpatched one with ``FRAMEWORK.unpatched()`` (every other record passes
   through) and writes ``.figures``, ``.switched_off``;
4. per micro-batch, ``forward_with_post_processing_fn``: ``dropped_rows:`` (outer) reads
   ``.current.metrics_only``; ``tiled:forward_with_post_processing_fn`` reads ``.tiled_on`` and
   > :data:`MICROBATCH`, whose ``lm_head`` forward writes ``.loss`` / ``.logps``;
   ``tiled:apply_temperature_scaling`` and ``tiled:call`` (``LossPostProcessor``) read them;
5. ``loss_call:call_v0x0`` (``ClippedPGLossFn.__call__``) reads ``.current`` (its metrics),
   ``.prev_diff`` / ``.reference_diff`` (verify mode's measurements) and the loss flags;
6. ``worker_train:aggregate_training_statistics`` reads the counters, ``.figures``,
   ``.switched_off`` into the metrics ``train`` returns, and leaves :data:`TRAIN`.

v0.5.0's worker has neither name: ``zero_advantage_v050:make_microbatch_iterator`` (``BatchedDataDict``)
> :data:`TRAIN` at each global batch of a ``train`` frame (its plan in ``.current``, the
counters carried by the loss metrics, ``.counters_in_loss``); ``loss_call:call_v050`` reads it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from grpo_patches.call_context import CallSlot

from . import FRAMEWORK, frames

#: On the loss object of a ``Policy.train`` call whose prev-logprob pass was skipped: the workers'
#: loss uses the detached current log-probs as ``prev_logprobs``.
PREV_IS_CURRENT = "_grpo_patches_prev_is_current"
#: ... of a verify step whose prev-logprob pass was skipped (the loss's own ``force_on_policy_ratio``):
#: ``data["prev_logprobs"]`` holds the real pass, for the workers to compare (:mod:`.verify`).
VERIFY_PREV = "_grpo_patches_verify_prev"
#: ... (``True``) of a verify step whose reference pass grpo_patches skipped (v0.6.0 at KL 0): the
#: workers compute the loss with and without the zero placeholder (:mod:`.verify`).
VERIFY_REFERENCE = "_grpo_patches_verify_reference"

#: Prefix of what the workers add to the metrics NeMo-RL logs.
METRIC_PREFIX = "grpo_patches/"
#: Set by a v0.5 / v0.6 worker's loss when it used the current log-probs as prev (:mod:`.loss_call`).
PREV_MARKER = METRIC_PREFIX + "prev_logprobs_from_current"
#: The zero-advantage filter's counters (``grpo_patches/<name>`` in the metrics).
COUNTERS = ("rows_dropped", "tokens_dropped", "micro_batches_dropped", "padding_tokens_skipped")


@dataclass
class PolicyState:
    """Per driver ``Policy``. :ivar reference_skipped: grpo_patches built it without its reference
    model (v0.5 / v0.6 at KL 0: its reference log-probs are zeros); :ivar worker_counters: the
    zero-advantage filter's counters its workers returned, summed."""

    reference_skipped: bool = False
    worker_counters: dict[str, float] = field(default_factory=dict)


@dataclass
class WorkerState:
    """Per DTensor policy worker: its optimizer steps so far (verify mode's step, 0-based)."""

    optimizer_steps: int = 0


@dataclass
class SetupCall:
    """One ``grpo.setup`` call. :ivar reference: the ``grpo_skip_reference_pass`` hook's decision
    (``None``: not asked), read when the policy is built (:mod:`.reference`)."""

    reference: Any = None


@dataclass
class LoopCall:
    """One synchronous ``grpo_train`` call.

    :ivar policy: the driver's ``Policy``; :ivar loss_fn: the loss object; :ivar config: ``master_config``.
    :ivar prev: this step's prev-logprob pass: ``"run"``, ``"skipped"`` (by grpo_patches), ``"upstream"``
        (NeMo-RL's ``force_on_policy_ratio``), ``"late"`` (run at train time: the call made more than one
        optimizer step) or ``"deferred"`` (run at train time on the rows some loss reads).
    :ivar placeholders: NeMo-RL filled this step's sequence-level log-prob error metrics with
        zero placeholders (they are dropped from the logs).
    :ivar unlogged: metric keys put back only because ``grpo_train`` reads them (a kept-rows
        value under an all-rows name): used by the loop, never logged.
    :ivar steps: the policy's training calls so far in this loop (verify mode's step, 0-based).
    """

    policy: Any
    loss_fn: Any
    config: Any
    prev: str = "run"
    placeholders: bool = False
    unlogged: set[str] = field(default_factory=set)
    steps: int = 0

    @property
    def prev_is_zero(self) -> bool:
        """``train_data["prev_logprobs"]`` holds placeholders this step (zeros; NaN rows when deferred)."""
        return self.prev in ("skipped", "upstream", "deferred")


@dataclass
class GlobalBatchFilter:
    """The zero-advantage filter's plan for one local global batch (worker side).

    :ivar rows_dropped, tokens_dropped, micro_batches_dropped, padding_tokens_skipped: saved on this
        rank (rows and tokens out of the forward and backward, passes, padding cut by :mod:`.trim`).
    :ivar kept_seqs, kept_toks: rows / loss tokens that ran, over every DP rank (the
        denominators of the ``/kept_rows`` metrics).
    :ivar metrics_only: the micro-batches that only give metrics (no gradient, :mod:`.dropped_rows`).
    :ivar dropped_seqs: valid samples among the dropped rows (``sample_mask`` sum).
    :ivar dropped: the dropped rows (v0.6.0+, real prev log-probs): their metrics that need no
        forward are added exactly by the first loss call of the global batch (:mod:`.metrics`).
    :ivar seen: the first loss call of the global batch happened (it carries the additions).
    :ivar counters_sent: v0.5.0: the counters rode on a micro-batch's metrics already.
    :ivar global_batches: how many global batches the train call has (v0.5.0's metric scale).
    """

    rows_dropped: int
    tokens_dropped: int
    micro_batches_dropped: int
    kept_seqs: float
    kept_toks: float
    padding_tokens_skipped: int = 0
    metrics_only: list[Any] = field(default_factory=list)
    dropped_seqs: float = 0.0
    dropped: Any = None
    seen: bool = False
    counters_sent: bool = False
    global_batches: int = 1

    def is_metrics_only(self, microbatch: Any) -> bool:
        return any(microbatch is mb for mb in self.metrics_only)


@dataclass
class TrainCall:
    """One ``train()`` call of a policy worker (v0.5.0: one global batch of it).

    :ivar worker: the worker; :ivar loss_fn: the loss object of the call.
    :ivar frame: ``(id, code)`` of the ``train`` frame running the call (:func:`current_train`).
    :ivar filter_on: the zero-advantage filter reshapes this call's micro-batches.
    :ivar tiled_on: the tiled lm-head loss computes this call's loss (:mod:`.tiled`).
    :ivar counters_in_loss: v0.5.0: the filter's counters ride on the loss metrics (no end-of-call hook).
    :ivar current: the filter's plan of the global batch being trained.
    :ivar rows_dropped, tokens_dropped, micro_batches_dropped, padding_tokens_skipped: totals over the call.
    Verify mode (:mod:`.verify`): :ivar remake: NeMo-RL's ``get_microbatch_iterator`` of the global
    batch, called again (``rebatch``: one row per micro-batch; ``None`` with sequence packing);
    :ivar prev_diff, reference_diff: the largest ``|current - prev|`` the loss calls saw, the largest
    loss difference with and without the reference placeholder (``None``: not measured);
    :ivar figures: the call's figures (the largest of each); :ivar switched_off: options it switched off.
    """

    worker: Any
    loss_fn: Any
    frame: tuple[int, Any] | None = None
    filter_on: bool = False
    tiled_on: bool = False
    counters_in_loss: bool = False
    current: GlobalBatchFilter | None = None
    rows_dropped: int = 0
    tokens_dropped: int = 0
    micro_batches_dropped: int = 0
    padding_tokens_skipped: int = 0
    remake: Any = None
    rebatch: Any = None
    prev_diff: float | None = None
    reference_diff: float | None = None
    figures: dict[str, float] = field(default_factory=dict)
    switched_off: dict[str, str] = field(default_factory=dict)
    exit: contextlib.ExitStack | None = field(default=None, repr=False)


@dataclass
class TiledMicrobatch:
    """One training micro-batch going through the tiled loss (:mod:`.tiled`)."""

    data: Any
    loss_fn: Any
    global_valid_seqs: Any
    global_valid_toks: Any
    temperature: float
    loss: Any = None
    logps: Any = None


SETUP: CallSlot[SetupCall] = CallSlot(f"{FRAMEWORK.name}.setup")
LOOP: CallSlot[LoopCall] = CallSlot(f"{FRAMEWORK.name}.loop")
TRAIN: CallSlot[TrainCall] = CallSlot(f"{FRAMEWORK.name}.train")
MICROBATCH: CallSlot[TiledMicrobatch] = CallSlot(f"{FRAMEWORK.name}.tiled_microbatch")


def current_train() -> TrainCall | None:
    """The worker ``train()`` call running on this thread's stack, if any: a call that raised is
    never read (its frame is gone), so ``get_logprobs`` and the like always see every row."""
    train = TRAIN.current()
    return train if train is not None and train.frame is not None and frames.running(train.frame) else None


def begin_train(train: TrainCall) -> None:
    """Enter ``train`` in :data:`TRAIN` until :func:`end_train` (step 1 of the module docstring);
    an earlier call still entered never reached its end (it raised): it is left first."""
    earlier = TRAIN.current()
    if earlier is not None:
        end_train(earlier)
    train.exit = contextlib.ExitStack()
    train.exit.enter_context(TRAIN.entered(train))


def end_train(train: TrainCall) -> None:
    """Leave ``train`` (entered by :func:`begin_train`)."""
    exit_, train.exit = train.exit, None
    if exit_ is not None:
        exit_.close()


def policy_state(policy: Any) -> PolicyState:
    return FRAMEWORK.state_of(policy, PolicyState)


def peek_policy(policy: Any) -> PolicyState | None:
    return FRAMEWORK.peek(policy)


def worker_state(worker: Any) -> WorkerState:
    return FRAMEWORK.state_of(worker, WorkerState)
