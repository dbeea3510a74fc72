"""``dropped_rows_metrics=True`` on verl's legacy ``DataParallelPPOActor`` (0.6.1-0.7.1): dropped
rows get a no-grad forward (:mod:`.filter_legacy`).

verl's micro-batches stay as they are. ``_forward_micro_batch`` (wrapped by
:mod:`.filter_legacy`) runs each training micro-batch as two forwards: the rows the
``grpo_filter_zero_advantage`` hook keeps with autograd, the others under ``torch.no_grad``,
and merges both outputs back into the micro-batch's row order, so verl's loss and every metric
see the whole micro-batch and the gradient is unchanged (dropped rows' loss terms are exactly
0; no backward runs through them). Under data parallelism every rank runs the same two
forwards (FSDP gathers per forward): a rank without dropped rows re-runs one kept row
without gradient.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable

#: (the micro-batch verl's loss sees, the rows of it this forward holds) inside the autograd forward.
_SUBSET: contextvars.ContextVar = contextvars.ContextVar("grpo_patches_verl_subset", default=None)


def world_size() -> int:
    """The default process group's size (1 without torch.distributed)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def split_forward(wrapped: Callable[..., Any], update: Any, micro: dict, args: tuple, kwargs: dict) -> Any:
    """``_forward_micro_batch`` of ``micro`` as two forwards: kept rows with autograd, dropped rows
    without; the outputs merged back into ``micro``'s row order. ``update``
    (:class:`.filter_legacy.Update`) counts the rows."""
    import torch

    from grpo_patches.plugins import hook

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
        return wrapped(*args, **kwargs)
    extra = drop if drop.numel() else keep[:1]  # DP: the same two forwards on every rank (FSDP gathers)

    def rows_of(index: Any) -> dict:
        return {k: (v[index] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows else v)
                for k, v in micro.items()}

    rest = args[1:] if args else ()
    named = {k: v for k, v in kwargs.items() if k != "micro_batch"}
    token = _SUBSET.set((micro, keep))
    try:
        kept_out = wrapped(rows_of(keep), *rest, **named)
    finally:
        _SUBSET.reset(token)
    with torch.no_grad():
        dropped_out = wrapped(rows_of(extra), *rest, **named)

    def merge(kept_value: Any, dropped_value: Any) -> Any:
        if kept_value is None:
            return None
        full = kept_value.new_zeros((rows, *kept_value.shape[1:]))
        if drop.numel():
            full = full.index_put((drop,), dropped_value.to(kept_value.dtype))
        return full.index_put((keep,), kept_value)

    if isinstance(kept_out, dict):  # 0.7: {"log_probs", "entropys", ...}
        return {k: merge(v, dropped_out.get(k)) for k, v in kept_out.items()}
    return tuple(merge(k, d) for k, d in zip(kept_out, dropped_out))  # 0.6: (entropy, log_probs)


def kept_rows_of(micro: dict) -> tuple[dict, Any]:
    """The micro-batch verl's loss will see and which of its rows ``micro`` holds (``None``: all).

    Differs from ``(micro, None)`` only inside the autograd forward of ``dropped_rows_metrics=True``."""
    subset = _SUBSET.get()
    return (micro, None) if subset is None else subset
