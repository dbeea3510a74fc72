"""Everything the verl adapter keeps: per-object state, and what its wrappers hand each other during one update.

**Per object** (``FRAMEWORK.state_of``, cleared by ``disable()``): :class:`ActorState` on each actor
or engine (decisions taken once, verify mode's step count), :class:`TrainerState` on each trainer.

**Per call**: one :class:`UpdateCall` per actor update (:data:`UPDATE`) and one
:class:`MicroBatchCall` per training micro-batch (:data:`MICRO_BATCH`). The outermost wrapper of
the call begins it; a wrapper that hands something on adds it as a field for the length of its
own call (:func:`in_update`, :func:`in_micro_batch`: the enclosing one comes back after it); the
others read the field (:func:`update`, :func:`micro_batch`). Nothing else holds a ``ContextVar``.

**One update, in run order.** Each patched attribute's stack outermost first, as
``status()["verl"]["stacks"]`` shows it (a record whose option is off is absent: the next one out
then begins the call); ``+f`` a field the wrapper adds for its call, ``<f`` one it reads.

Legacy actor (``DataParallelPPOActor``, 0.6.1-0.7.x):

1. ``update_policy``: verify_legacy (+verify, for verl's run then the patched one) > tiled_legacy
   (+tiled) > old_logprobs_legacy (+on_policy) > row_substitution (+rows) > reference (the KL loss
   off in the config) > zero_advantage_legacy (+zero_advantage, +split_plan: the filtered batch) > verl:
2. ``DataProto.split``: zero_advantage_legacy <split_plan; ``prepare_dynamic_batch``: <zero_advantage;
3. per micro-batch, ``_forward_micro_batch``: old_logprobs_legacy (<on_policy: entropies) >
   zero_advantage_legacy (<zero_advantage: re-weighted, trimmed; dropped_rows_legacy: the kept rows'
   forward +subset) > tiled_legacy (<tiled, <subset; +tiled call, left in tiled.pending) > verl's
   forward: ``FusedLinearForPPO.forward``: tiled (<tiled call);
4. verl's loss, ``get_policy_loss_fn``: row_substitution (<rows) > tiled_policy_loss (<tiled.pending)
   > placeholders (the guard);
5. ``_optimizer_step``: verify_legacy (<verify: keeps or compares the gradient) > row_substitution (<rows).

Engine (FSDP, 0.8+):

1. ``TrainingWorker.train_mini_batch`` (the batch): old_logprobs_engine (+on_policy) > row_substitution
   (+rows) > verl: per mini-batch ``train_batch``: row_substitution (<rows: a step more) >
2. ``FSDPEngine.forward_backward_batch``: verify_engine (+verify, the patched run; verl's runs
   unpatched) > reference (the KL loss off) > zero_advantage_engine (+packed: the unfiltered
   ``batch_num_tokens``; dropped_rows_metrics: +zero_advantage) > verl:
3. per micro-batch, ``FSDPEngineWithLMHead.forward_step``: old_logprobs_engine (<on_policy; its loss
   function +pass_old_log_probs) > dropped_rows_engine (<zero_advantage; the kept rows' forward
   +subset) > tiled_engine (<on_policy, <packed, <subset; +tiled call) > verl's forward
   (``FusedLinearForPPO.forward``: tiled <tiled call) and loss (``get_policy_loss_fn``:
   old_logprobs_engine <on_policy, verify_old_logprobs <pass_old_log_probs <verify > row_substitution
   <rows > tiled_policy_loss <tiled call > placeholders).

Megatron engine (0.8+): the engine's worker and loss records, and

1. ``MegatronEngine.forward_backward_batch``: verify_megatron (refused) > tiled_megatron (decided) >
   old_logprobs_megatron (<on_policy: its loss function) > reference_megatron > zero_advantage_megatron
   (the engine's filter on every pipeline stage: +packed, with the routed tokens under a per-token loss) >
2. Megatron's schedule, per micro-batch: ``forward_step``: tiled_megatron (+tiled call, for the forward
   and the loss) > ``linear_cross_entropy``: tiled_megatron (<tiled call); the loss:
   ``postprocess_micro_batch_func``: zero_advantage_megatron (<packed).

Legacy Megatron worker (0.6.1-0.7.x):

1. ``ActorRolloutRefWorker.update_actor``: old_logprobs_megatron_legacy (+on_policy) >
   reference_megatron (the KL loss off) > ``MegatronPPOActor.update_policy``: verify_megatron (refused)
   > tiled_megatron_legacy (+tiled) > zero_advantage_megatron_legacy (+zero_advantage) >
2. per mini-batch, ``forward_backward_batch``: zero_advantage_megatron_legacy (+packed) > verl:
   ``make_batch_generator`` (<packed), ``get_forward_backward_func``: tiled_megatron_legacy (<tiled;
   +tiled call per micro-batch, forward and loss) > ``linear_cross_entropy`` (<tiled call); the loss,
   ``get_policy_loss_fn``: old_logprobs_megatron_legacy (<on_policy) > tiled_policy_loss (<tiled call)
   > placeholders.

The trainers' records (``_compute_old_log_prob``, ``_update_actor``, ``need_reference_policy``) run in
another process than the update's, and hand over through :class:`TrainerState` and verl's metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from grpo_patches.call_context import CallSlot

from . import FRAMEWORK

# -- per object ------------------------------------------------------------------------------------


@dataclass
class ActorState:
    """Per actor (a legacy ``DataParallelPPOActor`` or ``MegatronPPOActor``, an engine): decided once."""

    filter_mode: str | None = None  # the filter: None (off), "pack", "nograd" (dropped_rows_metrics=True)
    decided: bool = False  # filter_mode was decided
    tiled: bool = False  # the tiled loss runs for this actor
    tiled_decided: bool = False
    optimizer_steps: int = 0  # verify mode's 0-based count of this actor's optimizer steps (:mod:`.verify`)


def of(obj: Any) -> ActorState:
    """The verl adapter's state for an actor or engine ``obj`` (created on first use)."""
    return FRAMEWORK.state_of(obj, ActorState)


#: :class:`TrainerState`'s answer from the workers before the trainer asked them.
NOT_ASKED = object()


@dataclass
class TrainerState:
    """Per trainer (:mod:`.skip_guarantee`, :mod:`.old_logprob_rows`)."""

    workers: Any = NOT_ASKED  # None once every actor-update process substitutes a skipped pass, else why not
    rows_workers: Any = NOT_ASKED  # the same for the minimal pass's skipped rows (recompute)
    pending: str | bool = False  # the next actor update must confirm a skipped "pass" or skipped "rows"
    deferred: Any = None  # the minimal pass, deferred until the update


def trainer(obj: Any) -> TrainerState:
    """The verl adapter's state for a trainer ``obj`` (created on first use)."""
    return FRAMEWORK.state_of(obj, TrainerState)


# -- one update ------------------------------------------------------------------------------------


@dataclass
class ZeroAdvantageUpdate:
    """The filter in one update (legacy lines: ``update_policy``; engine: a ``forward_backward_batch``)."""

    actor: Any
    mode: str | None
    denominator: str = "fixed"  # what each micro-batch's loss divides by (:data:`.loss_modes.DENOMINATORS`)
    trim: bool = False  # the kept rows' forwards run on the columns they use (:mod:`.trim_legacy`)
    rows_in: int = 0
    rows_kept: int = 0
    rows_dropped: int = 0
    tokens_dropped: int = 0
    padding_rows: int = 0
    grad_rows: int = 0  # rows through a forward with autograd
    micro_batches: int = 0
    micro_batches_unfiltered: int = 0  # legacy "pack": the micro-batches verl would have run (every epoch)
    padding_tokens_skipped: int = 0  # kept rows x padding columns cut from their forward


@dataclass
class SplitPlan:
    """The legacy actor's filtered batch as planned mini-batches, for its first ``DataProto.split``."""

    meta: dict
    total: int
    split_size: int
    sizes: list[int]
    consumed: bool = False


@dataclass
class PackedBatch:
    """One filtered mini-batch's kept rows as verl runs them (engine, Megatron, legacy Megatron)."""

    batch_num_tokens: int | None = None  # engine: the unfiltered global count ppo_loss divides by
    routed_num_tokens: int | None = None  # Megatron engine, per-token loss: the unfiltered global routed tokens
    dropped_routed_tokens: int = 0  # ... and this rank's dropped rows' routed tokens, reported once
    denominator: str = "fixed"  # legacy Megatron: what each micro-batch's loss divides by
    micro_batches: int = 0  # legacy Megatron: the micro-batches verl made of the kept rows


@dataclass
class RowUpdate:
    """An update that received the minimal pass's row placeholders (:mod:`.row_substitution`)."""

    filter_owner: Any  # where the filter's mode is kept (the legacy actor, the engine)
    steps: int = 0  # optimizer steps taken so far in this update (on this rank)
    substituted: int = 0  # placeholder rows the loss replaced by the current log-probs


@dataclass
class OnPolicyUpdate:
    """An update after a skipped old-logprob pass: its loss uses the detached current log-probs."""

    entropy: list = field(default_factory=list)  # (entropy [b, R], mask [b, R]) of each training forward
    rows_seen: int = 0  # the rows those forwards held (fewer than the batch's: the filter dropped some)
    forced_entropy: bool = False  # the forwards compute entropies only because the skip asked them to


@dataclass
class TiledUpdate:
    """The tiled loss in one legacy update (:mod:`.tiled_legacy`, :mod:`.tiled_megatron_legacy`)."""

    actor: Any
    on_policy: bool = False  # verl's loss uses log_prob.detach() as old log-probs (legacy actor)
    calls: int = 0  # the micro-batches whose loss was the tiled one
    pending: list = field(default_factory=list)  # legacy actor: each forward's call, until verl's loss takes it


@dataclass
class VerifyCapture:
    """What verify mode watches in one run of an update (:mod:`.verify_legacy`, :mod:`.verify_engine`)."""

    actor: Any = None
    compare: Callable[[int, list], None] | None = None  # legacy, patched run: check step i's gradient
    grads: list = field(default_factory=list)  # legacy, verl's run: each optimizer step's gradient
    old_logprob_diffs: list = field(default_factory=list)  # engine: the loss's old log-probs vs the pass's


@dataclass
class UpdateCall:
    """One actor update as its wrappers see it (the module docstring: who adds which field, in run order)."""

    zero_advantage: ZeroAdvantageUpdate | None = None
    split_plan: SplitPlan | None = None
    packed: PackedBatch | None = None
    rows: RowUpdate | None = None
    on_policy: OnPolicyUpdate | None = None
    tiled: TiledUpdate | None = None
    verify: VerifyCapture | None = None


# -- one training micro-batch ----------------------------------------------------------------------


@dataclass
class TiledCall:
    """One training micro-batch's tiled loss: what it needs before the forward, what it produced (:mod:`.tiled`).

    ``inputs()``: verl's ``[B, R]`` loss inputs read at forward time (``old_log_probs`` ``None``
    on-policy), so that a wrapper adjusting them before the forward (the filter's weights) is seen;
    ``positions(shape)``: each response token's index in the flattened hidden states of that shape.
    """

    owner: Any
    config: Any
    inputs: Callable[[], dict]
    positions: Callable[[tuple], Any]
    weights: Any  # [B_loss, R] fp32: each token's weight in verl's agg_loss
    loss_agg_mode: str
    info: dict  # the global counts verl's agg_loss gets (engine)
    calculate_entropy: bool
    responses: Any = None  # [B, R] labels to check against the rolled input ids (None: skip)
    rows: Any = None  # the rows of the micro-batch verl's loss sees that this forward holds (None: all)
    loss: Any = None  # the tiled loss (with its gradient), set by the forward
    used: dict = field(default_factory=dict)  # the [B, R] inputs the tiled loss used (detached)
    logps: Any = None  # [B, R] detached log-probs handed to verl
    declined: str | None = None  # why the forward did not compute the tiled loss


@dataclass
class MicroBatchCall:
    """One training micro-batch's forward (and, on the engine lines, its loss)."""

    subset: tuple[Any, Any] | None = None  # dropped_rows_metrics: (the micro-batch verl's loss sees, the kept rows)
    tiled: TiledCall | None = None
    pass_old_log_probs: Any = None  # a verify step (engine): the pass's old log-probs of this micro-batch


#: The actor update being made.
UPDATE: CallSlot[UpdateCall] = CallSlot("verl.update")
#: The training micro-batch being run.
MICRO_BATCH: CallSlot[MicroBatchCall] = CallSlot("verl.micro_batch")


def update() -> UpdateCall:
    """The update being made, as the enclosing wrappers left it (every field ``None`` outside one)."""
    return UPDATE.current() or UpdateCall()


def micro_batch() -> MicroBatchCall:
    """The training micro-batch being run (every field ``None`` outside one)."""
    return MICRO_BATCH.current() or MicroBatchCall()


@contextlib.contextmanager
def _adding(slot: CallSlot, empty: type, fields: dict) -> Iterator[Any]:
    current = slot.current()
    with slot.entered(empty(**fields) if current is None else dataclasses.replace(current, **fields)) as call:
        yield call


def in_update(**fields: Any) -> contextlib.AbstractContextManager[UpdateCall]:
    """The block as part of the update being made (begun here by its outermost wrapper), ``fields`` added."""
    return _adding(UPDATE, UpdateCall, fields)


def in_micro_batch(**fields: Any) -> contextlib.AbstractContextManager[MicroBatchCall]:
    """The block as part of the training micro-batch being run (begun here if none is), ``fields`` added."""
    return _adding(MICRO_BATCH, MicroBatchCall, fields)
