"""Aggregation of per-token losses into one number.

Every supported aggregation is linear in the per-token losses once the mask is known:
``loss = sum_t weight_t * loss_t``. The weights need only the mask (token and row counts),
so they are computed once, before any tile, and each tile then knows its tokens' exact
share of the loss. :func:`aggregate_dense` writes the same aggregations the way the
frameworks write them (it is the independent reference the tests compare against).
"""

from __future__ import annotations

import torch

from grpo_patches.errors import OptionError
from grpo_patches.tiled_loss.options import ROW_AGGREGATIONS, LossOptions


def _check_rows(aggregation: str, mask: torch.Tensor) -> None:
    if aggregation in ROW_AGGREGATIONS and mask.dim() != 2:
        raise OptionError(
            f"aggregation={aggregation!r} needs rows: pass hidden as [B, T, H] with labels/mask [B, T] "
            "(flat [N, H] inputs support 'token-mean' and 'token-sum')"
        )


def _row_length(opts: LossOptions, mask: torch.Tensor) -> float:
    return float(opts.max_completion_length or mask.shape[-1])


def token_weights(
    mask: torch.Tensor, aggregation: str, normalizer: float | torch.Tensor | None, opts: LossOptions
) -> torch.Tensor:
    """Per-token weights (same shape as ``mask``, fp32) with ``loss = (weights * per_token_loss).sum()``.

    ``normalizer`` replaces the local denominator: the token count for token-level
    aggregations, the row count for row-level ones (a global count kept by the caller).
    """
    _check_rows(aggregation, mask)
    m = mask if mask.is_floating_point() else mask.float()
    if aggregation == "token-sum":
        return m if normalizer is None else m / normalizer
    if aggregation == "token-mean":
        return m / (m.sum().clamp(min=1.0) if normalizer is None else normalizer)
    rows = float(m.shape[0]) if normalizer is None else normalizer
    if aggregation == "seq-mean-token-mean":
        return m / (m.sum(-1, keepdim=True).clamp(min=1.0) * rows)
    if aggregation == "seq-mean-token-sum":
        return m / rows
    return m / (rows * _row_length(opts, m))  # seq-mean-token-sum-norm


def aggregate_dense(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str,
    normalizer: float | torch.Tensor | None,
    opts: LossOptions,
) -> torch.Tensor:
    """The same aggregations written as TRL / verl write them (reference path)."""
    _check_rows(aggregation, mask)
    m = mask.to(per_token_loss.dtype)
    masked = per_token_loss * m
    if aggregation == "token-sum":
        return masked.sum() if normalizer is None else masked.sum() / normalizer
    if aggregation == "token-mean":
        return masked.sum() / (m.sum().clamp(min=1.0) if normalizer is None else normalizer)
    if aggregation == "seq-mean-token-mean":
        seq = masked.sum(-1) / m.sum(-1).clamp(min=1.0)
        return seq.mean() if normalizer is None else seq.sum() / normalizer
    if aggregation == "seq-mean-token-sum":
        seq = masked.sum(-1)
        return seq.mean() if normalizer is None else seq.sum() / normalizer
    rows = float(m.shape[0]) if normalizer is None else normalizer
    return masked.sum() / (rows * _row_length(opts, m))
