"""What the open-instruct adapter remembers: per learner, per step, per call; nothing else anywhere.

The DeepSpeed learner's ``step()`` cannot be wrapped (Ray ships its class by value, see the
package docstring), so a step is followed through the calls it makes, in this order:

1. ``CollatedBatchData.to`` (:func:`.steps.to`): the batch moved to the learner's device becomes
   this thread's :data:`PENDING` batch (``step()`` and ``train_batch`` call it first).
2. The first wrapper that meets one of a learner's models (a pass of ``compute_logprobs``, a
   ``forward_for_logprobs``) adopts it: :func:`.steps.step_of` builds the learner's
   :class:`StepState` (micro-batches after open-instruct's leftover drop, accumulation groups,
   the zero-advantage plan) on its :class:`LearnerState` (``FRAMEWORK.state_of``; learners are
   found by their models among :data:`LEARNERS`, filled by ``RayProcess.__init__`` and
   ``GRPOTrainModule.train_batch``).
3. ``compute_logprobs`` (reference pass, old-logprob pre-pass) enters a :class:`LogprobPass`
   (:data:`LOGPROB_PASS`): the pre-pass leaves NaN placeholders (:attr:`StepState.placeholders`);
   the tiled forward inside reads the pass's rows cursor for its token masks.
4. Per micro-step ``forward_for_logprobs``: verify mode (:mod:`.verify`), then the filter
   (:mod:`.dropped_rows`) and the tiled forward (:mod:`.tiled`); the outermost of them enters the
   call's :class:`ForwardCall` (:data:`FORWARD`: learner, micro-step; :attr:`StepState.current` is
   set then), the others join it; the tiled forward puts a :class:`TiledForward` in it that the
   swapped lm-head forward reads (labels, token mask, temperature) and fills (entropy).
   After it, ``resolve_old_logprob`` (:mod:`.placeholders`), the debug metrics and rho
   histograms (:mod:`.metrics`) and DeepSpeed's ``set_gradient_accumulation_boundary`` /
   ``backward`` (:mod:`.zero_advantage_deepspeed`) read :attr:`StepState.current`.
5. ``compute_metrics_from_loss_stats`` (:mod:`.metrics`) reads the step's plan and counters.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from grpo_patches.call_context import CallSlot

#: Framework objects that learn: the DeepSpeed learners (``PolicyTrainerRayProcess``) and
#: OLMo-core's ``GRPOTrainModule`` s of this process.
LEARNERS: "weakref.WeakSet[Any]" = weakref.WeakSet()


class _Thread(threading.local):
    batch: Any = None  # the last CollatedBatchData moved by this thread, until a step adopts it
    step: Any = None  # the StepState this thread adopted last (metrics wrappers that see no model read it)


#: The batch a step is about to train on (step 1 above) and the step in progress, per thread.
PENDING = _Thread()


@dataclass
class FilterPlan:
    """The zero-advantage filter's decisions for one step, per micro-step ``s`` (epochs flattened).

    :ivar useful: per micro-batch: some response token has a non-zero advantage.
    :ivar runs: per micro-step: it runs a forward and backward (useful, or a zero micro-batch kept
        so that every data-parallel rank makes the group's number of backwards).
    :ivar last_backward: per micro-step: the last micro-step of its group that runs (DeepSpeed's
        accumulation boundary moves there).
    """

    useful: list[bool]
    runs: list[bool]
    last_backward: list[bool]
    tokens_dropped: int = 0
    would_drop: set[int] = field(default_factory=set)  # kept only because verify mode checks their group

    def dropped(self, s: int) -> bool:
        return not self.runs[s]

    def run_all_from(self, first: int, accumulation_steps: int) -> None:
        """Every micro-step from ``first`` on runs, with open-instruct's own boundaries (verify mode's
        ``"disable"``: the filter is off from there)."""
        for s in range(first, len(self.runs)):
            self.runs[s] = True
            self.last_backward[s] = (s + 1) % accumulation_steps == 0 or s == len(self.runs) - 1


@dataclass
class Current:
    """The micro-step being trained: ``s`` (epochs flattened), its micro-batch ``i`` and epoch."""

    s: int
    i: int
    epoch: int


@dataclass
class StepState:
    """One step of one learner (``step()`` / ``train_batch``).

    :ivar data: the micro-batches the step trains on (DeepSpeed: after its leftover drop).
    :ivar accumulation_steps: micro-steps per optimizer step; :ivar epochs: ``num_epochs``.
    :ivar index: ``id(query_responses[i]) -> i`` (a forward is matched to its micro-batch).
    :ivar plan: the zero-advantage plan (``None``: the filter is off for this step).
    :ivar placeholders: micro-batch -> the NaN placeholder its skipped pre-pass left.
    :ivar pre_pass_skipped: micro-batches whose pre-pass was skipped because they are consumed
        before the first optimizer step (``recompute``).
    :ivar forwards: training forwards seen (the next one is micro-step ``forwards``).
    :ivar verify_first: the optimizer step (0-based) the step's first group makes.
    """

    learner: Any
    data: Any
    accumulation_steps: int
    epochs: int
    index: dict[int, int]
    plan: FilterPlan | None = None
    placeholders: dict[int, Any] = field(default_factory=dict)
    pre_pass_skipped: set[int] = field(default_factory=set)
    forwards: int = 0
    current: Current | None = None
    verify_first: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # grpo_patches/<name> in the step's metrics
    debug_sums: dict[str, float] = field(default_factory=dict)  # OLMo-core's debug metrics over useful rows
    debug_count: int = 0
    verify_groups: set[int] = field(default_factory=set)  # accumulation groups verify mode checks
    verify_old: dict[int, Any] = field(default_factory=dict)  # the unpatched pre-pass of the skipped ones
    verify_dropped: dict[int, float] = field(default_factory=dict)  # group -> max |dLoss/dlogps| of would-drops
    verify_metrics: dict[str, float] = field(default_factory=dict)  # grpo_patches/verify/<quantity>, the worst

    @property
    def n(self) -> int:
        return len(self.data.query_responses)

    def group_of(self, s: int) -> int:
        return s // self.accumulation_steps

    def add(self, **counts: int) -> None:
        for name, value in counts.items():
            self.counts[name] = self.counts.get(name, 0) + int(value)


@dataclass
class LearnerState:
    """Per learner (``FRAMEWORK.state_of``): its decisions, made once, and its current step.

    :ivar filter_on: the zero-advantage filter's decision (``None``: not made yet).
    :ivar tiled: per model (``id``): whether the tiled forward answers it.
    :ivar notes_made: ``status()`` notes already written (made once per learner).
    """

    filter_on: bool | None = None
    tiled: dict[int, bool] = field(default_factory=dict)
    step: StepState | None = None
    optimizer_steps: int = 0  # taken by the steps before the current one
    notes_made: set[str] = field(default_factory=set)


@dataclass
class LogprobPass:
    """One ``compute_logprobs`` call: its batch and how many of its rows the forwards have taken."""

    data: Any
    rows_done: int = 0


@dataclass
class TiledForward:
    """What the tiled forward of one ``forward_for_logprobs`` call hands its lm-head forward.

    :ivar labels: ``[B, T]`` next-token ids (open-instruct's: pad replaced by 0; 0 in the last column).
    :ivar mask: ``[B, T]`` which positions to compute (response tokens when known, else all but the last).
    :ivar logps, entropy: what the lm-head forward computed (``[B, T]``, entropy detached).
    """

    labels: Any
    mask: Any
    temperature: float
    entropy_wanted: bool
    tile_size: int | None
    logps: Any = None
    entropy: Any = None
    heads: int = 0  # lm-head forwards answered (exactly one per call, checked)
    verify_group: int | None = None  # the step's accumulation group verify mode checks this forward for
    step: Any = None  # the StepState (verify mode's figures)
    dense: bool = False  # verify mode's "disable": the unpatched (dense) log-probs and gradient were used


@dataclass
class ForwardCall:
    """One ``forward_for_logprobs`` call (entered by its outermost wrapper, joined by the others).

    :ivar learner: the learner whose model runs (``None``: a model of no learner: passed through).
    :ivar role: ``"policy"`` or ``"reference"``; :ivar training: a policy forward with autograd on.
    :ivar current: the training forward's micro-step (``None`` for the no-grad passes).
    :ivar tiled: set by the tiled forward for the swapped lm-head forward.
    """

    learner: Any = None
    step: StepState | None = None
    role: str | None = None
    training: bool = False
    current: Current | None = None
    tiled: TiledForward | None = None


#: The ``compute_logprobs`` call running (step 3).
LOGPROB_PASS: CallSlot[LogprobPass] = CallSlot("open_instruct.logprob_pass")
#: The ``forward_for_logprobs`` call running (step 4).
FORWARD: CallSlot[ForwardCall] = CallSlot("open_instruct.forward")
