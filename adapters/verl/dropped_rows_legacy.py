"""``dropped_rows_metrics=True`` on verl's legacy ``DataParallelPPOActor`` (0.6.1-0.7.1): dropped
rows get a no-grad forward (:mod:`.zero_advantage_legacy`).

verl's micro-batches stay as they are. ``_forward_micro_batch`` (wrapped by
:mod:`.zero_advantage_legacy`) runs each training micro-batch as two forwards: the rows the
``grpo_filter_zero_advantage`` hook keeps with autograd, the others under ``torch.no_grad``,
and merges both outputs back into the micro-batch's row order, so verl's loss and every metric
see the whole micro-batch and the gradient is unchanged (dropped rows' loss terms are exactly
0; no backward runs through them). Under data parallelism every rank runs the same two
forwards (FSDP gathers per forward): a rank without dropped rows re-runs one kept row
without gradient. The kept rows' forward runs with ``MicroBatchCall.subset`` (:mod:`.state`): the
tiled loss describes those rows of the micro-batch verl's loss sees.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.row_merge import merge_rows

from . import state


def world_size() -> int:
    """The default process group's size (1 without torch.distributed)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def split_forward(wrapped: Callable[..., Any], update: state.ZeroAdvantageUpdate, call: Any) -> Any:
    """``_forward_micro_batch`` (``call``: its arguments, bound) as two forwards: kept rows with
    autograd, dropped rows without; the outputs merged back into the micro-batch's row order.
    ``update`` counts the rows."""
    import torch

    from grpo_patches.plugins import hook

    micro = call["micro_batch"]
    mask, rows = micro["response_mask"], int(micro["response_mask"].shape[0])
    plan = hook().grpo_filter_zero_advantage(advantages=micro["advantages"], mask=mask, denominator="fixed", group=None)
    keep = plan.keep.cpu() if plan is not None else torch.arange(rows)
    dropped_mask = torch.ones(rows, dtype=torch.bool)
    dropped_mask[keep] = False
    drop = torch.nonzero(dropped_mask).flatten()
    update.rows_in += rows
    update.rows_kept += int(keep.numel()) - (plan.padding_rows if plan is not None else 0)
    update.tokens_dropped += plan.tokens_dropped if plan is not None else 0
    update.padding_rows += plan.padding_rows if plan is not None else 0
    update.grad_rows += int(keep.numel())
    update.micro_batches += 1
    if drop.numel() == 0 and world_size() == 1:
        return call.call(wrapped)
    extra = drop if drop.numel() else keep[:1]  # DP: the same two forwards on every rank (FSDP gathers)

    def rows_of(index: Any) -> dict:
        return {k: (v[index] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows else v)
                for k, v in micro.items()}

    with state.in_micro_batch(subset=(micro, keep)):
        kept_out = call.call(wrapped, micro_batch=rows_of(keep))
    with torch.no_grad():
        dropped_out = call.call(wrapped, micro_batch=rows_of(extra))

    def merge(kept_value: Any, dropped_value: Any) -> Any:  # no dropped rows: ``extra`` was a kept row, not merged
        return merge_rows(kept_value, keep, rows, dropped=dropped_value, drop=drop)

    if isinstance(kept_out, dict):  # 0.7: {"log_probs", "entropys", ...}
        return {k: merge(v, dropped_out.get(k)) for k, v in kept_out.items()}
    return tuple(merge(k, d) for k, d in zip(kept_out, dropped_out))  # 0.6: (entropy, log_probs)
