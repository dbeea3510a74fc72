"""``dropped_rows_metrics=True`` on verl's engine line (0.8+): dropped rows get a no-grad forward.

verl's micro-batches stay as they are (:mod:`.zero_advantage_engine` hands verl the unfiltered
mini-batch, ``UpdateCall.zero_advantage`` in ``"nograd"`` mode). ``FSDPEngineWithLMHead.forward_step``
(wrapped) runs each micro-batch as two forwards: the zero-advantage rows under ``torch.no_grad``
and the other rows with autograd (``MicroBatchCall.subset``: the tiled loss describes those rows),
then merges both model outputs back into the micro-batch's row order and calls verl's own
loss on the whole micro-batch. So every logged metric (clip fractions, ``ppo_kl``, entropy
sums) is verl's, and the gradient is unchanged: dropped rows' loss terms are exactly 0 (the
filter's preconditions) and no backward runs through them. Every rank runs the same two
forwards per micro-batch (FSDP gathers per forward), a rank without dropped rows re-runs one
kept row without gradient.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import bind
from grpo_patches.row_merge import merge_rows

from . import state
from .calls_engine import CONFIG_ATTRIBUTE, actor_config_of, advantages_and_mask


def forward_step(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``FSDPEngineWithLMHead.forward_step(micro_batch, loss_function, forward_only)``."""
    update = state.update().zero_advantage
    if update is None or update.mode != "nograd" or instance is None:
        return wrapped(*args, **kwargs)
    call = bind(wrapped, args, kwargs)
    micro, loss_function = call["micro_batch"], call["loss_function"]
    if call["forward_only"] or loss_function is None:
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
        merged.update({k: merge_rows(v, keep, rows, dropped=dropped_model.get(k), drop=drop)
                       for k, v in model_output.items()})
        return loss_function(model_output=merged, data=micro, dp_group=dp_group)

    setattr(loss_on_the_whole_micro_batch, CONFIG_ATTRIBUTE, actor_config_of(loss_function))
    with state.in_micro_batch(subset=(micro, keep)):  # the tiled loss: this forward holds these rows of ``micro``
        loss, output = wrapped(tu.index_select_tensor_dict(micro, keep), loss_on_the_whole_micro_batch, False)
    if merged:
        output["model_output"] = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in merged.items()}
    return loss, output
