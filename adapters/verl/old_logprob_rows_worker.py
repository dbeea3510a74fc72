"""The minimal old-logprob pass, worker side (option ``recompute``; trainer side: :mod:`.old_logprob_rows`).

The trainer runs the old-logprob pass only on the rows some loss reads after an optimizer
step; every other row reaches the update holding the row-level placeholder
(:data:`.placeholder.ROW_BITS`). Here, in the process that updates the actor:

* the update (legacy ``DataParallelPPOActor.update_policy``, 0.7.x; the engine's
  ``TrainingWorker.train_mini_batch``, 0.8+) that receives such rows opens a :class:`RowUpdate`
  and, once it returns, reports ``grpo_patches/old_log_probs_substituted`` in its metrics (the
  trainer stops the run when an update after a deferred pass does not: :mod:`.skip_guarantee`);
* its optimizer steps are counted (legacy ``_optimizer_step``; the engine's ``train_batch``,
  one per mini-batch), so which rows come first is what verl really ran: its split, shuffle,
  dynamic micro-batches and this data-parallel rank's share;
* verl's policy loss (``get_policy_loss_fn``, the binding each line's loss calls) gets, on
  placeholder elements, the detached current log-probs: before the first optimizer step these
  ARE the old policy's log-probs (what the pass would give, up to the pass's own rounding);
  after it only a row the zero-advantage filter kept at weight 0 may hold one (advantage
  exactly 0: no gradient whatever the ratio). Any other placeholder stops the run with
  :class:`~.placeholder.PlaceholderError` before the loss is computed — nothing trains on it.

Metrics computed inside the policy loss (``ppo_kl``, clip fractions) use what the loss used.
"""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass
from typing import Any, Callable

from . import metrics as verl_metrics
from . import placeholder, state
from .skip_guarantee import SUBSTITUTED

_UPDATE: contextvars.ContextVar = contextvars.ContextVar("grpo_patches_verl_row_update", default=None)


@dataclass
class RowUpdate:
    """One update that received row-level placeholders.

    :ivar filter_owner: the object the zero-advantage filter's mode is kept on (the legacy actor,
        or the engine), read when a placeholder row shows up after an optimizer step.
    :ivar steps: optimizer steps taken so far in this update (on this rank).
    :ivar substituted: placeholder rows the loss replaced by the current log-probs.
    """

    filter_owner: Any
    steps: int = 0
    substituted: int = 0


def _open(wrapped: Callable[..., Any], args: tuple, kwargs: dict, owner: Any) -> tuple[Any, RowUpdate]:
    update = RowUpdate(owner)
    token = _UPDATE.set(update)
    try:
        return wrapped(*args, **kwargs), update
    finally:
        _UPDATE.reset(token)


def update_policy(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the legacy ``DataParallelPPOActor.update_policy(data) -> metrics``."""
    data = args[0] if args else kwargs.get("data")
    if instance is None or data is None or "old_log_probs" not in data.batch.keys() \
            or not bool(placeholder.row_flags(data.batch["old_log_probs"]).any()):
        return wrapped(*args, **kwargs)
    metrics, update = _open(wrapped, args, kwargs, instance)
    metrics[SUBSTITUTED] = 1.0
    verl_metrics.report(None, old_logprob_substituted_updates=1)
    return metrics


def optimizer_step(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the legacy ``_optimizer_step`` / the engine's ``train_batch``: one step more."""
    update = _UPDATE.get()
    try:
        return wrapped(*args, **kwargs)
    finally:
        if update is not None:
            update.steps += 1


def train_mini_batch(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the engine's ``TrainingWorker.train_mini_batch(data)`` (the whole update)."""
    data = args[0] if args else kwargs.get("data")
    if instance is None or data is None or "old_log_probs" not in data.keys() \
            or not bool(placeholder.row_flags(data["old_log_probs"]).any()):
        return wrapped(*args, **kwargs)
    from verl.utils import tensordict_utils as tu

    output, update = _open(wrapped, args, kwargs, instance.engine)
    if output is not None:
        tu.get(output, "metrics")[SUBSTITUTED] = [1.0]
    verl_metrics.report(None, old_logprob_substituted_updates=1)
    return output


def get_policy_loss_fn(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``get_policy_loss_fn``: the policy loss it returns substitutes placeholder rows."""
    fn = wrapped(*args, **kwargs)
    return functools.partial(_substituting_loss, fn)


def _substituting_loss(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    old = kwargs.get("old_log_prob")
    if old is None:
        return fn(*args, **kwargs)
    flags = placeholder.row_flags(old)
    if not bool(flags.any()):
        return fn(*args, **kwargs)
    import torch

    update = _UPDATE.get()
    rows = flags.any(dim=-1)
    if update is None or update.steps > 0:
        _refuse_after_a_step(update, rows, kwargs)
    kwargs["old_log_prob"] = torch.where(flags, kwargs["log_prob"].detach(), old)
    if update is not None:
        update.substituted += int(rows.sum())
    return fn(*args, **kwargs)


def _refuse_after_a_step(update: RowUpdate | None, rows: Any, kwargs: dict) -> None:
    """A placeholder row after an optimizer step is allowed only at advantage exactly 0 with the
    filter packing rows (a row it kept at weight 0 to align ranks: no gradient, no metric of its own)."""
    advantages, mask = kwargs["advantages"], kwargs["response_mask"]
    per_token = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(mask)
    useful = ((per_token != 0) & (mask != 0)).any(dim=-1)
    packing = update is not None and state.of(update.filter_owner).filter_mode == "pack"
    if update is None or not packing or bool((rows & useful).any()):
        where = "outside an update that expects one" if update is None else f"after {update.steps} optimizer step(s)"
        raise placeholder.PlaceholderError(
            f"grpo_patches: {int(rows.sum())} row(s) reached verl's policy loss without old log-probs {where} "
            "(the trainer predicted that they would be consumed before the first optimizer step, or dropped by "
            "the zero-advantage filter); "
            "nothing was trained on them. Please report this and pass recompute=False "
            "(GRPO_PATCHES_OPTIONS=recompute=0)")
