"""The tile loop and its autograd Function.

The gradients are computed during the forward pass, tile by tile (the same 6·N·H·V GEMM
FLOPs as dense autograd, no logits recompute): a token's gradient coefficient needs only
its own log-prob (or its row's, for sequence-level terms) and the aggregation weights,
which depend on the mask alone. ``backward`` multiplies the stored gradients by the
incoming gradient, so ``(loss * k).backward()`` scales every gradient, the weight's too.
The weight is not needed in backward: under ZeRO-3 it may be re-partitioned as soon as
the forward returns, and its gradient still reaches DeepSpeed's hooks through autograd.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpo_patches.tiled_loss.fold import Fold, fold_enabled, fold_tokens
from grpo_patches.tiled_loss.gemm import LmHead, without_autocast
from grpo_patches.tiled_loss.inputs import FlatBatch
from grpo_patches.tiled_loss.objective import TokenInputs, token_objective
from grpo_patches.tiled_loss.options import LossOptions
from grpo_patches.tiled_loss.tile_math import (
    GradBuffers,
    apply_tile_grads,
    compact_rows_,
    compute_logits,
    explicit_logit_grad,
    fold_onehot_,
    label_chain,
    rows_with_gradient,
    softmax_stats,
)
from grpo_patches.tiled_loss.tiling import choose_tile_size, tile_bounds

METRIC_SUMS = ("ratio", "low_clipped", "high_clipped", "dual_clipped", "kl", "entropy", "phi")


@dataclass
class LoopResult:
    """What the forward pass produced besides the loss (all detached)."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)  # mask-weighted sums of METRIC_SUMS
    token_values: dict[str, torch.Tensor] = field(default_factory=dict)  # per-token [N] outputs
    tile_size: int = 0
    n_tiles: int = 0


def _take(x: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor | None:
    return None if x is None else x[idx]


def _tile_inputs(batch: FlatBatch, idx: torch.Tensor) -> TokenInputs:
    row, n_rows = None, 0
    if batch.row is not None:
        row_ids, row = torch.unique_consecutive(batch.row[idx], return_inverse=True)
        n_rows = row_ids.numel()
    return TokenInputs(
        advantages=batch.advantages[idx],
        mask=batch.mask[idx],
        old_logps=_take(batch.old_logps, idx),
        ref_logps=_take(batch.ref_logps, idx),
        is_weights=_take(batch.is_weights, idx),
        sampling_logps=_take(batch.sampling_logps, idx),
        policy_token_mask=_take(batch.policy_token_mask, idx),
        row=row,
        n_rows=n_rows,
    )


def run_tiles(
    batch: FlatBatch,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    opts: LossOptions,
    grads: GradBuffers | None,
    result: LoopResult,
) -> torch.Tensor:
    """Loop over tiles of unmasked tokens; returns the loss, fills ``grads`` and ``result``."""
    acc = batch.mask.dtype
    hidden = batch.hidden
    vocab = weight.shape[0]
    selected = torch.nonzero(batch.mask != 0).flatten()
    n_sel = selected.numel()
    all_selected = n_sel == batch.mask.numel()
    use_fold = fold_enabled(hidden.device, hidden.dtype)
    tile = fold_tokens(n_sel, opts) if use_fold else choose_tile_size(n_sel, vocab, opts)
    rows_sel = batch.row[selected] if (opts.needs_whole_rows and batch.row is not None) else None
    bounds = tile_bounds(n_sel, tile, rows_sel)
    result.tile_size, result.n_tiles = tile, len(bounds)
    loss = torch.zeros((), dtype=acc, device=hidden.device)
    for name in METRIC_SUMS:
        result.sums[name] = torch.zeros((), dtype=acc, device=hidden.device)
    if opts.return_logps:
        result.token_values["logps"] = torch.zeros(batch.mask.shape, dtype=acc, device=hidden.device)
    if opts.needs_entropy:
        result.token_values["entropy"] = torch.zeros(batch.mask.shape, dtype=acc, device=hidden.device)
    if opts.return_token_metrics:
        for name in ("ratio", "low_clipped", "high_clipped", "kl", "phi"):
            result.token_values[name] = torch.zeros(batch.mask.shape, dtype=acc, device=hidden.device)
    if not bounds:
        return loss

    max_rows = max(e - s for s, e in bounds)
    entropy_grad = grads is not None and opts.entropy_coef != 0.0
    if use_fold:
        fold = Fold(weight, bias, opts, max_rows)
    else:
        fold = None
        logits_buf = torch.empty(max_rows, vocab, dtype=acc, device=hidden.device)
        head = LmHead.for_inputs(weight, bias, acc)
        rounds = grads is not None and head.rounds_logit_grad
        lp_buf = torch.empty(max_rows, vocab, dtype=weight.dtype, device=hidden.device) if rounds else None
        softcap_grad = grads is not None and opts.logit_softcap is not None
        # what the logits buffer must hold for the gradient: the softcap's tanh, log p for the
        # entropy term, else p
        leave = "any" if grads is None else "tanh" if softcap_grad else "log_probs" if entropy_grad else "probs"

    for start, end in bounds:
        n = end - start
        idx = selected[start:end]
        token_index = slice(start, end) if all_selected else idx
        h_tile = hidden[token_index]
        labels = batch.labels[idx]
        if fold is not None:
            stats = fold.stats(h_tile, labels, opts.needs_entropy)
        else:
            z = logits_buf[:n]
            compute_logits(z, h_tile, head, opts, keep_tanh=softcap_grad)
            stats = softmax_stats(z, labels, opts.needs_entropy, opts, leave=leave)

        inputs = _tile_inputs(batch, idx)
        with torch.enable_grad():
            logps = stats.logps.detach().requires_grad_(grads is not None)
            per_token, tstats = token_objective(logps, inputs, opts)
            tile_loss = (batch.weights[idx] * per_token).sum()
            entropy = None
            if opts.entropy_coef != 0.0:
                entropy = stats.entropy.detach().requires_grad_(grads is not None)
                tile_loss = tile_loss - opts.entropy_coef * (batch.entropy_weights[idx] * entropy).sum()
            if grads is not None:
                wrt = [logps] if entropy is None else [logps, entropy]
                tile_grads = torch.autograd.grad(tile_loss, wrt, allow_unused=True)
        loss += tile_loss.detach()
        _record(result, opts, idx, inputs.mask, stats, tstats)

        if grads is None:
            continue
        g = tile_grads[0] if tile_grads[0] is not None else torch.zeros_like(stats.logps)
        g_entropy = tile_grads[1] if len(tile_grads) > 1 else None
        keep = rows_with_gradient(g, g_entropy)
        if keep is not None and fold is not None and not fold.skip_pays(keep.numel(), n):
            keep = None
        if keep is not None:  # rows of exactly zero gradient leave the gradient GEMMs
            if keep.numel() == 0:
                continue
            g, stats, h_tile, labels = g[keep], stats.rows(keep), h_tile[keep], labels[keep]
            g_entropy = None if g_entropy is None else g_entropy[keep]
            token_index = (torch.arange(start, end, device=hidden.device) if all_selected else token_index)[keep]
        if fold is not None:
            fold.apply_grads(grads, h_tile, labels, stats, g, g_entropy, token_index)
            continue
        if keep is not None:
            z = compact_rows_(z, keep)
        if entropy_grad or softcap_grad or rounds:
            onehot = g * label_chain(stats, opts)
            explicit_logit_grad(z, stats, g, g_entropy, leave, opts)
            row_scale = None
        else:  # z holds p: dL/dr = -g s/T (p - onehot), the one-hot term folded into z, the scale on [n, H]
            z.index_put_((torch.arange(z.shape[0], device=z.device), labels), torch.tensor(-1.0, dtype=z.dtype),
                         accumulate=True)
            onehot = None
            row_scale = -g * opts.logit_chain
        dense_lp = None
        if rounds:
            fold_onehot_(z, labels, onehot)
            onehot = None
            dense_lp = lp_buf[: z.shape[0]]
            dense_lp.copy_(z)
        apply_tile_grads(grads, head, z, dense_lp, row_scale, onehot, h_tile, labels, token_index)
    return loss


def _record(result: LoopResult, opts: LossOptions, idx, mask, stats, tstats) -> None:
    """Add one tile's mask-weighted metric sums and per-token outputs."""
    values = {
        "ratio": tstats.ratio,
        "low_clipped": tstats.low_clipped,
        "high_clipped": tstats.high_clipped,
        "dual_clipped": tstats.dual_clipped,
        "kl": tstats.kl,
        "entropy": stats.entropy,
        "phi": tstats.phi,
    }
    for name, value in values.items():
        if value is not None:
            result.sums[name] += (value.to(mask.dtype) * mask).sum()
    if "logps" in result.token_values:
        result.token_values["logps"][idx] = stats.logps
    if "entropy" in result.token_values:
        result.token_values["entropy"][idx] = stats.entropy
    if opts.return_token_metrics:
        for name in ("ratio", "low_clipped", "high_clipped", "kl", "phi"):
            if values[name] is not None:
                result.token_values[name][idx] = values[name].to(mask.dtype)


class TiledGRPOLossFunction(torch.autograd.Function):
    """Autograd wrapper: forward runs the tile loop with gradients, backward scales them."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, batch: FlatBatch, opts: LossOptions, result: LoopResult, needs):
        need_h, need_w, need_b = needs
        acc = batch.mask.dtype
        grads = None
        if need_h or need_w or need_b:
            dev = hidden.device
            grads = GradBuffers(
                hidden=torch.zeros(hidden.shape, dtype=acc, device=dev) if need_h else None,
                weight=torch.empty(weight.shape, dtype=acc, device=dev) if need_w else None,
                bias=torch.zeros(weight.shape[0], dtype=acc, device=dev) if need_b else None,
            )
        batch.hidden = hidden
        with without_autocast(hidden.device):
            loss = run_tiles(batch, weight, bias, opts, grads, result)
        if grads is not None and grads.weight is not None and not grads.weight_written:
            grads.weight.zero_()  # no unmasked token: the gradient is zero
        ctx.grads = grads
        ctx.retain_grads = opts.retain_grads
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return loss.to(torch.float64 if acc == torch.float64 else torch.float32)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output):
        grads: GradBuffers | None = ctx.grads
        if grads is None:
            raise RuntimeError(
                "tiled_grpo_loss: backward ran twice (retain_graph=True); its gradients are computed in the "
                "forward pass and handed over by the first backward. Pass retain_grads=True to keep a copy "
                "(gradcheck, double backward passes), or call tiled_grpo_loss again."
            )
        keep = ctx.retain_grads
        if not keep:
            ctx.grads = None  # drop our reference so autograd can adopt the buffers without a copy
        scale_is_one = grad_output.device.type == "cpu" and bool(grad_output == 1)
        out = []
        for buf, dtype in zip((grads.hidden, grads.weight, grads.bias), ctx.dtypes):
            if buf is None:
                out.append(None)
            elif keep:
                out.append((buf * grad_output.to(buf.dtype)).to(dtype))
            else:
                if not scale_is_one:
                    buf.mul_(grad_output.to(buf.dtype))
                out.append(buf if buf.dtype == dtype else buf.to(dtype))
        del grads
        return out[0], out[1], out[2], None, None, None, None
