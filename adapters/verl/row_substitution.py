"""The minimal old-logprob pass's row substitution, worker side (option ``recompute``; trainer side:
:mod:`.old_logprob_rows`).

The trainer runs the old-logprob pass only on the rows some loss reads after an optimizer
step; every other row reaches the update holding the row-level placeholder
(:data:`.placeholders.ROW_BITS`). Here, in the process that updates the actor:

* the update (legacy ``DataParallelPPOActor.update_policy``, 0.7.x; the engine's
  ``TrainingWorker.train_mini_batch``, 0.8+) that receives such rows holds a
  :class:`~.state.RowUpdate` (``UpdateCall.rows``) and, once it returns, reports
  ``grpo_patches/old_log_probs_substituted`` in its metrics (the
  trainer stops the run when an update after a deferred pass does not: :mod:`.skip_guarantee`);
* its optimizer steps are counted (legacy ``_optimizer_step``; the engine's ``train_batch``,
  one per mini-batch), so which rows come first is what verl really ran: its split, shuffle,
  dynamic micro-batches and this data-parallel rank's share;
* verl's policy loss (``get_policy_loss_fn``, the binding each line's loss calls) gets, on
  placeholder elements, the detached current log-probs: before the first optimizer step these
  ARE the old policy's log-probs (what the pass would give, up to the pass's own rounding);
  after it only a row the zero-advantage filter kept at weight 0 may hold one (advantage
  exactly 0: no gradient whatever the ratio). Any other placeholder stops the run with
  :class:`~.placeholders.PlaceholderError` before the loss is computed — nothing trains on it.

Metrics computed inside the policy loss (``ppo_kl``, clip fractions) use what the loss used.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from grpo_patches.call_args import bind

from . import metrics as verl_metrics
from . import placeholders, state
from .skip_guarantee import SUBSTITUTED


def _holds_row_placeholders(fields: Any) -> bool:
    """Whether a batch's tensors (``fields``: a ``TensorDict``) hold old log-probs with row placeholders."""
    return "old_log_probs" in fields.keys() and bool(placeholders.row_flags(fields["old_log_probs"]).any())


def update_policy(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the legacy ``DataParallelPPOActor.update_policy(data) -> metrics``."""
    data = bind(wrapped, args, kwargs)["data"] if instance is not None else None
    if data is None or not _holds_row_placeholders(data.batch):
        return wrapped(*args, **kwargs)
    with state.in_update(rows=state.RowUpdate(instance)):
        metrics = wrapped(*args, **kwargs)
    metrics[SUBSTITUTED] = 1.0
    verl_metrics.report(None, old_logprob_substituted_updates=1)
    return metrics


def optimizer_step(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the legacy ``DataParallelPPOActor._optimizer_step()``: one step more."""
    update = state.update().rows
    try:
        return wrapped(*args, **kwargs)
    finally:
        if update is not None:
            update.steps += 1


def train_batch(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the engine's ``TrainingWorker.train_batch(data)`` (one mini-batch, one optimizer step)."""
    return optimizer_step(wrapped, instance, args, kwargs)


def train_mini_batch(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the engine's ``TrainingWorker.train_mini_batch(data)`` (the whole update)."""
    data = bind(wrapped, args, kwargs)["data"] if instance is not None else None
    if data is None or not _holds_row_placeholders(data):
        return wrapped(*args, **kwargs)
    from verl.utils import tensordict_utils as tu

    with state.in_update(rows=state.RowUpdate(instance.engine)):
        output = wrapped(*args, **kwargs)
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
    flags = placeholders.row_flags(old)
    if not bool(flags.any()):
        return fn(*args, **kwargs)
    import torch

    update = state.update().rows
    rows = flags.any(dim=-1)
    if update is None or update.steps > 0:
        _refuse_after_a_step(update, rows, kwargs)
    kwargs["old_log_prob"] = torch.where(flags, kwargs["log_prob"].detach(), old)
    if update is not None:
        update.substituted += int(rows.sum())
    return fn(*args, **kwargs)


def _refuse_after_a_step(update: state.RowUpdate | None, rows: Any, kwargs: dict) -> None:
    """A placeholder row after an optimizer step is allowed only at advantage exactly 0 with the
    filter packing rows (a row it kept at weight 0 to align ranks: no gradient, no metric of its own)."""
    advantages, mask = kwargs["advantages"], kwargs["response_mask"]
    per_token = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(mask)
    useful = ((per_token != 0) & (mask != 0)).any(dim=-1)
    packing = update is not None and state.of(update.filter_owner).filter_mode == "pack"
    if update is None or not packing or bool((rows & useful).any()):
        where = "outside an update that expects one" if update is None else f"after {update.steps} optimizer step(s)"
        raise placeholders.PlaceholderError(
            f"grpo_patches: {int(rows.sum())} row(s) reached verl's policy loss without old log-probs {where} "
            "(the trainer predicted that they would be consumed before the first optimizer step, or dropped by "
            "the zero-advantage filter); "
            "nothing was trained on them. Please report this and pass recompute=False "
            "(GRPO_PATCHES_OPTIONS=recompute=0)")
