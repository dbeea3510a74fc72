"""Pack the kept rows of an accumulation window into full micro-batches (option ``pack_kept_rows``).

The zero-advantage filter alone leaves a hole in each micro-batch: at 75 % zero-advantage rows
and GA = 4 a window still runs 4 forward/backward calls of about a quarter of a micro-batch
each, and on a GPU a call costs about the same with 1 row or 4. TRL's buffered generation batch
(``GRPOTrainer._buffered_inputs``, served as ``_buffered_inputs[_step % steps_per_generation]``)
already holds every micro-batch the rest of the window will train on, so the wrapper of
``_prepare_inputs`` re-deals the rows of that *segment* (the window's micro-steps left in the
buffer) before TRL serves them:

* the rows the ``grpo_filter_zero_advantage`` hook keeps for their gradient go, in their
  original order, into the segment's last ``C = ceil(kept / rows per micro-batch)``
  micro-batches (the most kept rows of any data-parallel rank decide ``C``, so every rank runs
  the same calls), topped up with zero-advantage rows to the original size;
* the first ``n - C`` micro-batches hold zero-advantage rows only: the filter
  (:mod:`.zero_advantage`) gives them no forward and no backward (:func:`skipped`), counted as
  ``micro_batches_dropped``.

Every micro-batch keeps its size and every row all its columns, so a row's loss weight is the
one it had: exact for the denominators that do not depend on which rows share a micro-batch
(``fixed``: dapo, cispo, vespo; ``rows``: grpo, sapo, dr_grpo, luspo; equal-size micro-batches).
The window's last micro-step always has kept rows: the one where DDP reduces gradients runs a
backward. Nothing else changes: the number of micro-steps and optimizer steps, TRL's buffer
(later iterations re-read it unchanged), the logged loss (a sum of the same per-row terms).

Not packed, with the reason in ``status()`` (``"auto"``; ``True`` refuses the trainer when it
is built): ``bnpo`` (a token mean over each micro-batch), ``dropped_rows_metrics=True``,
multimodal rollouts, DeepSpeed / FSDP (a micro-step without a backward). With the tiled loss the
dealt micro-batches are computed tile by tile like any other. A segment is served to its end
once dealt. On a verify step every dealt micro-step is verified as any other (a skipped one's gradient, 0, against TRL's
on the same rows: a kept row dealt there would show), and every deal is checked to hold each row
of the window exactly once. TRL's clip fractions are per-micro-batch means: under packing they
are not logged (a note says so).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from grpo_patches.errors import GrpoPatchesError

from . import FRAMEWORK, overrides, state, zero_advantage
from .accumulation_window import window_index, window_length
from .dropped_micro_batches import NOTE
from .loss_modes import loss_mask
from .row_subsets import is_multimodal

#: Denominators under which moving a row to another micro-batch of the same size keeps its weight.
EXACT_DENOMINATORS = ("fixed", "rows")
#: Accelerate distributed types whose micro-steps may skip their backward (DDP reduces in the
#: window's last one, which always runs).
_SKIPPABLE = ("NO", "MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_HPU")


@dataclass
class Segment:
    """The re-dealt micro-batches of micro-steps ``start .. start + len(batches) - 1``.

    :ivar buffer: TRL's buffer they were dealt from (a new rollout makes a new segment).
    :ivar batches: the micro-batch served at each micro-step (TRL's own when not packed).
    :ivar skipped: ids of the micro-batches with no kept row (no forward, no backward).
    :ivar dealt: ids of every micro-batch dealt (empty when the segment is TRL's own).
    """

    buffer: Any
    start: int
    batches: list
    skipped: set[int] = field(default_factory=set)
    dealt: set[int] = field(default_factory=set)

    def covers(self, trainer: Any, step: int) -> bool:
        return self.buffer is trainer._buffered_inputs and self.start <= step < self.start + len(self.batches)


def why_not(trainer: Any) -> str | None:
    """Why the trainer's windows cannot be packed (``None``: they can); decided once per trainer."""
    if not FRAMEWORK.on("pack_kept_rows"):
        return "pack_kept_rows is off"
    if not FRAMEWORK.on("zero_advantage_filter") or not zero_advantage.decide(trainer):
        return "the zero-advantage filter is off for this trainer"
    if FRAMEWORK.on("dropped_rows_metrics"):
        return "dropped_rows_metrics=True forwards every row for its metrics"
    objective = state.of(trainer).objective
    if objective.denominator not in EXACT_DENOMINATORS:
        return (f"loss_type={objective.name!r} divides by each micro-batch's tokens: a moved row would "
                "change its weight")
    kind = str(getattr(trainer.accelerator, "distributed_type", "NO")).rsplit(".", 1)[-1]
    if kind not in _SKIPPABLE:
        return f"{kind}: a micro-step without a backward is not known to be safe there"
    if not isinstance(getattr(trainer, "_buffered_inputs", None), (list, type(None))):
        return "TRL's buffered generation batch is not a list here"
    return overrides.why_off(trainer, "pack_kept_rows")


def decide(trainer: Any) -> bool:
    """Whether packing runs for ``trainer`` (decided once, when the trainer is built: :mod:`.on_init`).

    :raises IncompatibleOptionsError: ``pack_kept_rows=True`` with a setting it cannot reproduce.
    """
    own = state.of(trainer)
    if own.pack_on is None:
        reason = why_not(trainer)
        own.pack_on = reason is None or FRAMEWORK.refuse_or_note(NOTE, [reason], owner=trainer)
    return own.pack_on


def prepare_inputs(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``GRPOTrainer._prepare_inputs``: serve the micro-step its re-dealt micro-batch."""
    step = int(getattr(instance, "_step", 0))  # this micro-step (TRL < 1.x bumps it inside the method)
    inputs = wrapped(*args, **kwargs)
    if instance is None or not instance.model.training:
        return inputs
    own = state.of(instance)
    # a segment is served to its end, even after verify mode switched packing off in it: its rows
    # are dealt once (TRL's micro-batches now would train some rows twice and others never)
    if own.segment is None or not own.segment.covers(instance, step):
        if not FRAMEWORK.on("pack_kept_rows") or not decide(instance):
            own.segment = None
            return inputs
        own.segment = _segment(instance, step, inputs)
    return own.segment.batches[step - own.segment.start]


def _segment(trainer: Any, step: int, current: Mapping[str, Any]) -> Segment:
    """Deal the rows of the window's micro-steps left in TRL's buffer (module docstring)."""
    buffer = trainer._buffered_inputs
    spg = int(trainer.args.steps_per_generation)
    ga = int(trainer.args.gradient_accumulation_steps)
    left = min(window_length(trainer, ga) - window_index(trainer), spg - step % spg)
    batches = [current] + [buffer[(step + i) % spg] for i in range(1, max(left, 1))]
    plain = Segment(buffer, step, batches)
    if len(batches) < 2:
        return plain
    if any(is_multimodal(batch) for batch in batches):
        FRAMEWORK.note(NOTE, "multimodal micro-batches are not packed", owner=trainer)
        return plain
    size = _layout(batches)
    if size is None:
        FRAMEWORK.note(NOTE, "micro-batches of unequal size or layout are not packed", owner=trainer)
        return plain
    kept = _kept_rows(trainer, batches, size)
    calls = max(1, -(-_most_over_ranks(trainer, sum(len(rows) for rows in kept)) // size))
    if calls >= len(batches):
        return plain
    order = _order(kept, size, len(batches), calls)
    if sorted(order) != [(b, r) for b in range(len(batches)) for r in range(size)]:
        raise GrpoPatchesError("grpo_patches: pack_kept_rows would deal the window's rows with a row missing or "
                               "twice (a bug, nothing was trained on it); pass pack_kept_rows=False to "
                               "grpo_patches.enable('trl', ...) and report it")
    dealt = _deal(batches, order, size)
    return Segment(buffer, step, dealt, {id(batch) for batch in dealt[:len(batches) - calls]},
                   {id(batch) for batch in dealt})


def _layout(batches: list) -> int | None:
    """Rows per micro-batch when every micro-batch has the same size and keys (else ``None``)."""
    import torch

    keys = set(batches[0])
    sizes = set()
    for batch in batches:
        if set(batch) != keys:
            return None
        for name, value in batch.items():
            if isinstance(value, list) or (isinstance(value, torch.Tensor) and value.dim() > 0):
                sizes.add(len(value))
            elif value is not batches[0][name] and not _same(value, batches[0][name]):
                return None  # a per-micro-batch value that is not a row: cannot be re-dealt
    return sizes.pop() if len(sizes) == 1 else None


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return a == b


def _kept_rows(trainer: Any, batches: list, size: int) -> list[list[int]]:
    """Per micro-batch, the rows the hook keeps for their gradient (weight != 0): asked once for
    the whole segment (one collective and one host read per window, not one per micro-batch;
    a row's decision reads its own advantages only, and rows kept to align ranks weigh 0)."""
    import torch

    from grpo_patches.plugins import hook

    advantages = torch.cat([batch["advantages"] for batch in batches])
    plan = hook().grpo_filter_zero_advantage(advantages=advantages, mask=torch.cat([loss_mask(b) for b in batches]),
                                             denominator=state.of(trainer).objective.denominator, group=None)
    rows = range(len(advantages)) if plan is None else plan.keep[plan.weights.to(plan.keep.device) != 0].tolist()
    out: list[list[int]] = [[] for _ in batches]
    for row in rows:
        out[row // size].append(row % size)
    return out


def _most_over_ranks(trainer: Any, count: int) -> int:
    """The largest ``count`` of any data-parallel rank (every rank then runs as many calls)."""
    import torch

    if getattr(trainer.accelerator, "num_processes", 1) <= 1 or not torch.distributed.is_initialized():
        return count
    value = torch.tensor([count], device=trainer.accelerator.device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return int(value.item())


def _order(kept: list[list[int]], size: int, micro_batches: int, calls: int) -> list[tuple[int, int]]:
    """``(micro-batch, row)`` in dealing order: zero-advantage rows first, so that the last
    ``calls`` micro-batches hold every kept row (in its original order), topped up with them."""
    kept_pairs = [(b, r) for b, rows in enumerate(kept) for r in rows]
    taken = set(kept_pairs)
    dropped = [(b, r) for b in range(micro_batches) for r in range(size) if (b, r) not in taken]
    fillers = calls * size - len(kept_pairs)
    split = len(dropped) - fillers
    return dropped[:split] + kept_pairs + dropped[split:]


def _deal(batches: list, order: list[tuple[int, int]], size: int) -> list[dict]:
    """New micro-batches of ``size`` rows, taking the rows in ``order`` (every per-row value moves)."""
    import torch

    flat = [b * size + r for b, r in order]
    index: dict[Any, Any] = {}  # one index tensor per device
    out: list[dict] = [{} for _ in batches]
    for name, first in batches[0].items():
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            if first.device not in index:
                index[first.device] = torch.tensor(flat, device=first.device)
            whole = torch.cat([batch[name] for batch in batches]).index_select(0, index[first.device])
            parts: list = list(whole.split(size))
        elif isinstance(first, list):
            whole_list = [item for batch in batches for item in batch[name]]
            picked = [whole_list[i] for i in flat]
            parts = [picked[i * size:(i + 1) * size] for i in range(len(batches))]
        else:
            parts = [first] * len(batches)
        for batch, part in zip(out, parts):
            batch[name] = part
    return out
