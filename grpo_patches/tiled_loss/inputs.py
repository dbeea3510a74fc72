"""Validate and flatten the loss inputs: ``[B, T, H]`` or ``[N, H]`` hidden states to ``[N, H]``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_patches.errors import OptionError
from grpo_patches.tiled_loss.aggregation import token_weights
from grpo_patches.tiled_loss.options import LossOptions


@dataclass
class FlatBatch:
    """Flattened inputs; per-token tensors are ``[N]`` fp32 (labels long)."""

    hidden: torch.Tensor  # [N, H]
    labels: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    weights: torch.Tensor  # aggregation weight of each token's policy loss
    entropy_weights: torch.Tensor | None  # aggregation weight of each token's entropy bonus (times entropy_token_mask)
    old_logps: torch.Tensor | None
    ref_logps: torch.Tensor | None
    is_weights: torch.Tensor | None
    sampling_logps: torch.Tensor | None
    policy_token_mask: torch.Tensor | None
    row: torch.Tensor | None  # row of each token ([B, T] inputs only)
    n_rows: int
    token_shape: torch.Size  # shape of labels, for per-token outputs


def _per_token(
    name: str, value: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype
) -> torch.Tensor | None:
    if value is None:
        return None
    value = torch.as_tensor(value)
    if value.shape != shape:
        raise OptionError(f"{name} has shape {tuple(value.shape)}; expected {tuple(shape)} (one value per label)")
    return value.detach().reshape(-1).to(dtype)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 softmax/objective math for fp32/bf16/fp16 inputs; fp64 stays fp64 (gradcheck)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_head_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Check the lm-head inputs' shapes and dtypes; returns the mask (all ones when ``None``)."""
    if hidden.dim() not in (2, 3):
        raise OptionError(f"hidden must be [N, H] or [B, T, H]; got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise OptionError(
            f"weight must be [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}; got {tuple(weight.shape)}"
        )
    if bias is not None and bias.shape != (weight.shape[0],):
        raise OptionError(f"bias must be [V] = [{weight.shape[0]}]; got {tuple(bias.shape)}")
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise OptionError(f"hidden, weight and bias must share a dtype; got {hidden.dtype} and {weight.dtype}")
    shape = hidden.shape[:-1]
    if labels.shape != shape:
        raise OptionError(f"labels has shape {tuple(labels.shape)}; expected {tuple(shape)} (hidden without H)")
    if mask is None:
        mask = torch.ones(shape, device=hidden.device)
    if mask.shape != shape:
        raise OptionError(f"mask has shape {tuple(mask.shape)}; expected {tuple(shape)}")
    return mask


def flatten_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    is_weights: torch.Tensor | None,
    sampling_logps: torch.Tensor | None,
    policy_token_mask: torch.Tensor | None = None,
    entropy_token_mask: torch.Tensor | None = None,
    bias: torch.Tensor | None,
    opts: LossOptions,
) -> FlatBatch:
    """Check shapes and build the flat batch with its aggregation weights."""
    mask = check_head_inputs(hidden, weight, labels, mask, bias)
    shape = hidden.shape[:-1]
    acc = accumulation_dtype(hidden.dtype)
    mask = mask.detach().to(acc)
    advantages = torch.as_tensor(advantages, device=hidden.device).detach().to(acc)
    if hidden.dim() == 3 and advantages.shape == shape[:1]:
        advantages = advantages[:, None].expand(shape)
    elif advantages.dim() == 0:
        advantages = advantages.expand(shape)
    if advantages.shape != shape:
        raise OptionError(
            f"advantages has shape {tuple(advantages.shape)}; expected {tuple(shape)} (per token)"
            + (f" or {(shape[0],)} (per row)" if hidden.dim() == 3 else "")
        )
    if opts.beta != 0.0 and ref_logps is None:
        raise OptionError(f"beta={opts.beta} needs ref_logps (or set beta=0 to skip the KL term)")
    if opts.needs_whole_rows and hidden.dim() != 3:
        raise OptionError(
            "sequence-level quantities (importance_sampling_level='sequence', objective='vespo', "
            "off_policy_mask_threshold) need rows: pass hidden [B, T, H] with labels/mask [B, T]"
        )
    weights = token_weights(mask, opts.aggregation, opts.normalizer, opts).reshape(-1)
    entropy_weights = None
    if opts.entropy_coef != 0.0:
        if opts.entropy_aggregation is None:
            entropy_weights = weights
        else:
            entropy_weights = token_weights(mask, opts.entropy_aggregation, opts.entropy_normalizer, opts)
            entropy_weights = entropy_weights.reshape(-1)
        entropy_mask = _per_token("entropy_token_mask", entropy_token_mask, shape, acc)
        if entropy_mask is not None:  # a multiplier only: the denominators stay the mask's
            entropy_weights = entropy_weights * entropy_mask
    else:
        _per_token("entropy_token_mask", entropy_token_mask, shape, acc)  # checked, unused without the bonus
    row = None
    n_rows = 0
    if hidden.dim() == 3:
        n_rows = shape[0]
        row = torch.arange(n_rows, device=hidden.device).repeat_interleave(shape[1])
    n = labels.numel()
    return FlatBatch(
        hidden=hidden.reshape(n, hidden.shape[-1]),
        labels=labels.reshape(-1).long(),
        mask=mask.reshape(-1),
        advantages=advantages.reshape(-1),
        weights=weights,
        entropy_weights=entropy_weights,
        old_logps=_per_token("old_logps", old_logps, shape, acc),
        ref_logps=_per_token("ref_logps", ref_logps, shape, acc),
        is_weights=_per_token("is_weights", is_weights, shape, acc),
        sampling_logps=_per_token("sampling_logps", sampling_logps, shape, acc),
        policy_token_mask=_per_token("policy_token_mask", policy_token_mask, shape, acc),
        row=row,
        n_rows=n_rows,
        token_shape=shape,
    )
