"""Per-token log-probs and entropies from hidden states, tile by tile, without gradients.

What an adapter needs *before* the loss when a token's weight depends on the policy's own
distribution, e.g. TRL's high-entropy token mask (``top_entropy_quantile < 1``): the mask is a
quantile over every process's entropies, so it must exist before any gradient coefficient.
Same logits as :func:`~grpo_patches.tiled_loss.tiled_grpo_loss` (same transforms, same GEMMs, and on
CUDA the same fused fold: :mod:`~grpo_patches.tiled_loss.fold`).
"""

from __future__ import annotations

import torch

from grpo_patches.tiled_loss.fold import Fold, fold_enabled, fold_tokens
from grpo_patches.tiled_loss.gemm import LmHead, without_autocast
from grpo_patches.tiled_loss.inputs import accumulation_dtype, check_head_inputs
from grpo_patches.tiled_loss.options import resolve_options
from grpo_patches.tiled_loss.tile_math import compute_logits, softmax_stats
from grpo_patches.tiled_loss.tiling import choose_tile_size, tile_bounds
from grpo_patches.tiled_loss.zero3 import gathered_weight


@torch.no_grad()
def tiled_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: float | None = None,
    tile_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each label and entropy of each position under ``softmax(logits / temperature)``.

    Arguments as in :func:`~grpo_patches.tiled_loss.tiled_grpo_loss`. Only unmasked tokens are
    computed (``mask != 0``; ``None`` = all).

    :return: ``(logps, entropy)``, each ``labels``' shape, fp32 (fp64 for fp64 inputs), detached,
        0 where masked.
    """
    opts = resolve_options(
        temperature=temperature, logit_scale=logit_scale, logit_softcap=logit_softcap,
        tile_size=tile_size,
    )
    mask = check_head_inputs(hidden, weight, labels, mask, bias)
    acc = accumulation_dtype(hidden.dtype)
    shape = labels.shape
    logps = torch.zeros(shape.numel(), dtype=acc, device=hidden.device)
    entropy = torch.zeros_like(logps)
    selected = torch.nonzero(mask.reshape(-1) != 0).flatten()
    use_fold = fold_enabled(hidden.device, hidden.dtype)
    n_sel = selected.numel()
    bounds = tile_bounds(n_sel, fold_tokens(n_sel, opts) if use_fold else choose_tile_size(
        n_sel, weight.shape[0], opts), None)
    if not bounds:
        return logps.reshape(shape), entropy.reshape(shape)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1).long()
    max_rows = max(e - s for s, e in bounds)
    with gathered_weight(weight, bias), without_autocast(hidden.device):  # ZeRO-3: the full weight, this pass only
        if use_fold:
            fold = Fold(weight, bias, opts, max_rows)
        else:
            head = LmHead.for_inputs(weight, bias, acc)
            buf = torch.empty(max_rows, weight.shape[0], dtype=acc, device=hidden.device)
        for start, end in bounds:
            idx = selected[start:end]
            if use_fold:
                stats = fold.stats(flat_hidden[idx], flat_labels[idx], True)
            else:
                z = buf[: end - start]
                compute_logits(z, flat_hidden[idx], head, opts, keep_tanh=False)
                stats = softmax_stats(z, flat_labels[idx], True, opts, leave="any")
            logps[idx] = stats.logps
            entropy[idx] = stats.entropy
    return logps.reshape(shape), entropy.reshape(shape)
