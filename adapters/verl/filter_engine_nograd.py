"""``dropped_rows_metrics=True`` on verl's engine line (0.8+): dropped rows get a no-grad forward.

verl's micro-batches stay as they are (:mod:`.filter_engine` hands verl the unfiltered
mini-batch). ``FSDPEngineWithLMHead.forward_step`` (wrapped) runs each micro-batch as two
forwards: the zero-advantage rows under ``torch.no_grad`` and the other rows with autograd,
then merges both model outputs back into the micro-batch's row order and calls verl's own
loss on the whole micro-batch. So every logged metric (clip fractions, ``ppo_kl``, entropy
sums) is verl's, and the gradient is unchanged: dropped rows' loss terms are exactly 0 (the
filter's preconditions) and no backward runs through them. Every rank runs the same two
forwards per micro-batch (FSDP gathers per forward), a rank without dropped rows re-runs one
kept row without gradient.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass
from typing import Any, Callable

from .engine_calls import CONFIG_ATTRIBUTE, actor_config_of, advantages_and_mask

#: The counters of the nograd update running in this context (``None`` outside one).
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("grpo_patches_verl_engine_nograd", default=None)
#: (the micro-batch verl's loss sees, the rows of it this forward holds) inside the autograd forward.
_SUBSET: contextvars.ContextVar = contextvars.ContextVar("grpo_patches_verl_engine_subset", default=None)


@dataclass
class NogradUpdate:
    rows_in: int = 0
    grad_rows: int = 0
    tokens_dropped: int = 0


def activate(update: NogradUpdate) -> contextvars.Token:
    return _ACTIVE.set(update)


def reset(token: contextvars.Token) -> None:
    _ACTIVE.reset(token)


def kept_rows_of(micro: Any) -> tuple[Any, Any]:
    """The micro-batch verl's loss will see and which of its rows ``micro`` holds (``None``: all).

    Differs from ``(micro, None)`` only inside the autograd forward of a micro-batch split here."""
    subset = _SUBSET.get()
    return (micro, None) if subset is None else subset


def _bind(micro_batch: Any, loss_function: Callable | None = None, forward_only: bool = False) -> tuple:
    return micro_batch, loss_function, forward_only


def _merge(kept: Any, dropped: Any, keep: Any, extra_is_dropped: bool, drop: Any, rows: int) -> Any:
    """One model-output field of the whole micro-batch from the kept rows' (with autograd) and
    the dropped rows' (no gradient) fields, padded ``[b, ...]`` or jagged nested ``[b, j]``."""
    import torch

    if not isinstance(kept, torch.Tensor):
        return kept
    if getattr(kept, "is_nested", False):
        pieces: list = [None] * rows
        for i, row in zip(keep.tolist(), kept.unbind()):
            pieces[i] = row
        if extra_is_dropped:
            for i, row in zip(drop.tolist(), dropped.unbind()):
                pieces[i] = row.to(kept.dtype)
        lengths = torch.tensor([p.shape[0] for p in pieces])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(kept.device)
        return torch.nested.nested_tensor_from_jagged(torch.cat(pieces), offsets=offsets)
    full = kept.new_zeros((rows, *kept.shape[1:]))
    if extra_is_dropped:
        full = full.index_put((drop.to(kept.device),), dropped.to(kept.dtype))
    return full.index_put((keep.to(kept.device),), kept)


def forward_step(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``FSDPEngineWithLMHead.forward_step(micro_batch, loss_function, forward_only)``."""
    update = _ACTIVE.get()
    micro, loss_function, forward_only = _bind(*args, **kwargs)
    if update is None or instance is None or forward_only or loss_function is None:
        return wrapped(*args, **kwargs)
    import torch
    from verl.utils import tensordict_utils as tu

    from grpo_patches.plugins import hook

    adv, mask = advantages_and_mask(micro)
    rows = int(mask.shape[0])
    plan = hook().grpo_filter_zero_advantage(advantages=adv, mask=mask, denominator="fixed", group=None)
    keep = plan.keep.cpu() if plan is not None else torch.arange(rows)
    if keep.numel() == 0:  # every row dropped: one still runs with autograd (its gradient is exactly 0)
        keep = torch.arange(1)
    dropped = torch.ones(rows, dtype=torch.bool)
    dropped[keep] = False
    drop = torch.nonzero(dropped).flatten()
    update.rows_in += rows
    update.grad_rows += int(keep.numel())
    update.tokens_dropped += int((mask.cpu() != 0)[dropped].sum())
    if drop.numel() == 0 and not (torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
        return wrapped(*args, **kwargs)
    extra = drop if drop.numel() else keep[:1]  # the same two forwards on every rank
    with torch.no_grad():
        _, dropped_output = wrapped(tu.index_select_tensor_dict(micro, extra), None, True)
    dropped_model = dropped_output["model_output"]
    merged: dict = {}

    def loss_on_the_whole_micro_batch(model_output: dict, data: Any = None, dp_group: Any = None) -> Any:
        merged.update({k: _merge(v, dropped_model.get(k), keep, bool(drop.numel()), drop, rows)
                       for k, v in model_output.items()})
        return loss_function(model_output=merged, data=micro, dp_group=dp_group)

    setattr(loss_on_the_whole_micro_batch, CONFIG_ATTRIBUTE, actor_config_of(loss_function))
    token = _SUBSET.set((micro, keep))  # the tiled loss: this forward holds these rows of ``micro``
    try:
        loss, output = wrapped(tu.index_select_tensor_dict(micro, keep), loss_on_the_whole_micro_batch, False)
    finally:
        _SUBSET.reset(token)
    if merged:
        output["model_output"] = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in merged.items()}
    return loss, output
