"""What the NeMo-RL adapter remembers: one object per framework object or call, never loose attributes.

Driver side: :class:`PolicyState` per ``Policy`` (``grpo_patches.instance_state``, cleared by
``disable()``) and :class:`LoopState` for one ``grpo_train`` call. Worker side:
:class:`TrainCall` for one ``DTensorPolicyWorkerV2.train`` call and :class:`GlobalBatchFilter`
for each global batch the zero-advantage filter reshaped. Calls are found through context
variables: a driver loop lives exactly as long as the call; a worker train call from its first
global batch to its statistics (:func:`active_train`).

One thing does cross from the driver to the workers on the loss object NeMo-RL pickles to
them on every ``Policy.train`` call: :data:`PREV_IS_CURRENT`, a plain ``bool`` attribute (so
that a worker without grpo_patches can still unpickle the loss), set only for that call.
"""

from __future__ import annotations

import contextvars
import sys
from dataclasses import dataclass, field
from typing import Any

from grpo_patches import instance_state

FRAMEWORK = "nemo_rl"

#: Set on the loss object for one ``Policy.train`` call whose prev-logprob pass was skipped:
#: the worker's loss then uses the detached current log-probs as ``prev_logprobs``.
PREV_IS_CURRENT = "_grpo_patches_prev_is_current"

#: Set on the loss object for one ``Policy.train`` call on a verify step whose prev-logprob pass was
#: skipped: ``data["prev_logprobs"]`` then holds the real pass (run for verification only), which
#: the patched loss does not read and the worker compares with the log-probs it used (:mod:`.verify`).
VERIFY_PREV = "_grpo_patches_verify_prev"

#: Set (``True``) on the loss object for one ``Policy.train`` call on a verify step whose reference
#: pass grpo_patches skipped (v0.6.0: no reference model at KL 0): the worker computes the loss
#: with and without the zero placeholder (:mod:`.verify`).
VERIFY_REFERENCE = "_grpo_patches_verify_reference"

#: Prefix of what the workers add to the metrics NeMo-RL logs.
METRIC_PREFIX = "grpo_patches/"
#: Set by a v0.5 / v0.6 worker's loss when it used the current log-probs as prev (:mod:`.loss_call`).
PREV_MARKER = METRIC_PREFIX + "prev_logprobs_from_current"
#: The zero-advantage filter's counters (``grpo_patches/<name>`` in the metrics).
COUNTERS = ("rows_dropped", "tokens_dropped", "microbatches_dropped", "padding_tokens_skipped")


@dataclass
class PolicyState:
    """Per driver ``Policy``.

    :ivar reference_skipped: the reference model was not built for this policy by grpo_patches
        (v0.5 / v0.6), so its reference log-probs are answered with zeros (KL penalty 0).
    :ivar worker_counters: the zero-advantage filter's counters its workers returned, summed.
    """

    reference_skipped: bool = False
    worker_counters: dict[str, float] = field(default_factory=dict)


def policy_state(policy: Any) -> PolicyState:
    return instance_state.state_of(policy, FRAMEWORK, PolicyState)


def peek_policy(policy: Any) -> PolicyState | None:
    return instance_state.peek(policy, FRAMEWORK)


@dataclass
class LoopState:
    """One synchronous ``grpo_train`` call.

    :ivar policy: the driver's ``Policy``; :ivar loss_fn: the loss object; :ivar config: ``master_config``.
    :ivar on_policy: why the prev-logprob pass may be skipped (``None``: it may), decided once
        per call from the config (:mod:`.old_logprobs`).
    :ivar prev: this step's prev-logprob pass: ``"run"``, ``"skipped"`` (by grpo_patches),
        ``"upstream"`` (NeMo-RL's own ``force_on_policy_ratio``), ``"late"`` (skipped, then
        run at train time because the train call made more than one optimizer step) or
        ``"deferred"`` (run at train time on the rows some loss reads, :mod:`.prev_rows`).
    :ivar placeholders: NeMo-RL filled this step's sequence-level log-prob error metrics with
        zero placeholders (they are dropped from the logs).
    :ivar bypass: call the original ``get_logprobs`` (a late pass).
    :ivar unlogged: metric keys put back only because ``grpo_train`` reads them (a kept-rows
        value under an all-rows name): used by the loop, never logged.
    :ivar steps: the policy's training calls so far in this loop (verify mode's step, 0-based).
    """

    policy: Any
    loss_fn: Any
    config: Any
    on_policy: str | None = None
    prev: str = "run"
    placeholders: bool = False
    bypass: bool = False
    unlogged: set[str] = field(default_factory=set)
    steps: int = 0

    @property
    def prev_is_zero(self) -> bool:
        """``train_data["prev_logprobs"]`` holds placeholders this step (zeros; NaN rows when deferred)."""
        return self.prev in ("skipped", "upstream", "deferred")


ACTIVE_LOOP: contextvars.ContextVar[LoopState | None] = contextvars.ContextVar("grpo_patches_nemo_loop", default=None)


@dataclass
class GlobalBatchFilter:
    """The zero-advantage filter's plan for one local global batch (worker side).

    :ivar rows_dropped, tokens_dropped: left out of the forward and backward on this rank.
    :ivar microbatches_dropped: forward/backward passes saved on this rank.
    :ivar padding_tokens_skipped: padding token positions of the rows that ran, cut from their
        micro-batches on this rank (:mod:`.trim`).
    :ivar kept_seqs, kept_toks: rows / loss tokens that ran, over every DP rank (the
        denominators of the ``/kept_rows`` metrics).
    :ivar metrics_only: the micro-batches that only give metrics (no gradient).
    :ivar dropped_seqs: valid samples among the dropped rows (``sample_mask`` sum).
    :ivar dropped: the dropped rows (v0.6.0+, real prev log-probs): their metrics that need no
        forward are added exactly by the first loss call of the global batch (:mod:`.metrics`).
    :ivar seen: the first loss call of the global batch happened (it carries the additions).
    :ivar counters_sent: v0.5.0: the counters rode on a micro-batch's metrics already.
    :ivar global_batches: how many global batches the train call has (v0.5.0's metric scale).
    :ivar train_frame: v0.5.0: ``(id, code)`` of the worker ``train`` frame the plan belongs to.
    """

    rows_dropped: int
    tokens_dropped: int
    microbatches_dropped: int
    kept_seqs: float
    kept_toks: float
    padding_tokens_skipped: int = 0
    metrics_only: list[Any] = field(default_factory=list)
    dropped_seqs: float = 0.0
    dropped: Any = None
    seen: bool = False
    counters_sent: bool = False
    global_batches: int = 1
    train_frame: tuple[int, Any] | None = None

    def is_metrics_only(self, microbatch: Any) -> bool:
        return any(microbatch is mb for mb in self.metrics_only)


@dataclass
class TrainCall:
    """One ``DTensorPolicyWorkerV2.train`` call in a worker (v0.6.0+), made at its first global
    batch (:mod:`.worker_train`).

    :ivar worker: the worker; :ivar loss_fn: the loss object of the call.
    :ivar frame_id, code: the ``train`` frame running the call (:func:`active_train`).
    :ivar filter_on: the zero-advantage filter reshapes this call's micro-batches.
    :ivar tiled_on: the tiled lm-head loss computes this call's loss (:mod:`.tiled`).
    :ivar current: the filter's plan of the global batch being trained.
    :ivar rows_dropped, tokens_dropped, microbatches_dropped, padding_tokens_skipped: totals over the call.
    :ivar unpatched: verify mode runs NeMo-RL's unpatched computation (:func:`active_train` is
        ``None`` meanwhile: every worker wrapper passes through).
    :ivar remake: verify mode: NeMo-RL's ``get_microbatch_iterator`` of the global batch being
        trained, called again (:mod:`.verify`); ``rebatch``: the same, one row per micro-batch
        (``None`` with sequence packing).
    :ivar prev_diff: verify mode: the largest ``|current - prev|`` the loss calls saw (``None``:
        not measured on this global batch).
    :ivar reference_diff: verify mode: the largest difference of the loss with and without the
        reference pass's placeholder (``None``: not measured).
    :ivar figures: verify mode's figures of the call (the largest of each).
    :ivar switched_off: verify mode switched these options off during the call (for the driver).
    """

    worker: Any
    loss_fn: Any
    frame_id: int = 0
    code: Any = None
    filter_on: bool = False
    tiled_on: bool = False
    current: GlobalBatchFilter | None = None
    rows_dropped: int = 0
    tokens_dropped: int = 0
    microbatches_dropped: int = 0
    padding_tokens_skipped: int = 0
    unpatched: bool = False
    remake: Any = None
    rebatch: Any = None
    prev_diff: float | None = None
    reference_diff: float | None = None
    figures: dict[str, float] = field(default_factory=dict)
    switched_off: dict[str, str] = field(default_factory=dict)


@dataclass
class WorkerState:
    """Per DTensor policy worker: its optimizer steps so far (verify mode's step, 0-based)."""

    optimizer_steps: int = 0


def worker_state(worker: Any) -> WorkerState:
    return instance_state.state_of(worker, FRAMEWORK, WorkerState)


#: The last train call begun on this thread (its end unsets it; :func:`active_train` checks it still runs).
ACTIVE_TRAIN: contextvars.ContextVar[TrainCall | None] = contextvars.ContextVar("grpo_patches_nemo_train", default=None)


def active_train() -> TrainCall | None:
    """The worker ``train()`` call running on this thread's stack, if any (v0.6.0+).

    A call that raised leaves :data:`ACTIVE_TRAIN` set; it counts only while its own ``train``
    frame is on the stack, so ``get_logprobs`` and the like never see it. ``None`` too while
    verify mode runs NeMo-RL's unpatched computation (:attr:`TrainCall.unpatched`)."""
    train = ACTIVE_TRAIN.get()
    if train is None or train.unpatched:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if id(frame) == train.frame_id and frame.f_code is train.code:
            return train
        frame = frame.f_back
    return None
#: v0.5.0 has no per-call hook point in the worker (see :mod:`.filter_v050`): the plan of the
#: global batch being trained, replaced at each global batch (read through :func:`current_v050`).
CURRENT_V050: contextvars.ContextVar[GlobalBatchFilter | None] = contextvars.ContextVar(
    "grpo_patches_nemo_v050", default=None)


def current_v050() -> GlobalBatchFilter | None:
    """v0.5.0's plan, only while the ``train`` frame it was made in runs on this thread's stack (a
    plan left over from an earlier call, e.g. before a ``disable()`` / ``enable()``, is never read)."""
    plan = CURRENT_V050.get()
    if plan is None or plan.train_frame is None:
        return plan
    frame = sys._getframe(1)
    while frame is not None:
        if (id(frame), frame.f_code) == plan.train_frame:
            return plan
        frame = frame.f_back
    return None
