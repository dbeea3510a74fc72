"""The [tile, vocab] work of one tile: logits, log-softmax statistics, and the gradient GEMMs.

The logits buffer is reused for every tile and modified in place (log-softmax, then exp:
two fused passes). With ``z = (h W^T + b) / T``, ``p = softmax(z)`` and ``g = dL/dlogp``,
the gradient of the loss w.r.t. the raw logits is ``(g * onehot(y) - g * p) / T`` (plus an
entropy term). The dense part ``-g p / T = diag(s) p`` with ``s = -g / T`` is applied as a
row scale on the small side of the GEMMs (``[tile, H]``), so no extra pass over the logits
is needed; the one-hot part is a gather / index_add of ``tile`` rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Rows per block of the optional entropy passes (32 x 151936 fp32 = 19 MB of scratch).
ROW_BLOCK = 32


@dataclass
class TileStats:
    logps: torch.Tensor  # [n] log-prob of each label
    entropy: torch.Tensor | None  # [n]


def compute_logits(
    out: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    low_precision_buffer: torch.Tensor | None,
) -> None:
    """``out[:] = (hidden @ weight.T + bias) / temperature`` in out's (accumulation) dtype."""
    inv_t = 1.0 / temperature
    if low_precision_buffer is None:
        if bias is None:
            torch.addmm(out, hidden, weight.t(), beta=0, alpha=inv_t, out=out)
        else:
            torch.addmm(bias, hidden, weight.t(), beta=inv_t, alpha=inv_t, out=out)
        return
    # bf16/fp16: the GEMM runs in the input dtype (as the dense path does), softmax in fp32
    if bias is None:
        torch.mm(hidden, weight.t(), out=low_precision_buffer)
    else:
        torch.addmm(bias, hidden, weight.t(), out=low_precision_buffer)
    out.copy_(low_precision_buffer)
    if temperature != 1.0:
        out.mul_(inv_t)


def _log_softmax_(z: torch.Tensor) -> None:
    """In-place log-softmax over the vocabulary: one fused, row-parallel pass (cache-resident rows).

    Few large parallel regions matter on a busy CPU: every region waits for its slowest thread.
    """
    try:
        torch._log_softmax(z, 1, False, out=z)
    except RuntimeError:  # a torch that refuses aliased out=: row blocks through a scratch buffer
        for r0 in range(0, z.shape[0], ROW_BLOCK):
            blk = z[r0 : r0 + ROW_BLOCK]
            blk.copy_(torch.log_softmax(blk, 1))


def softmax_stats(z: torch.Tensor, labels: torch.Tensor, need_entropy: bool, keep_log_probs: bool) -> TileStats:
    """Log-prob of the labels (and entropy) of logits ``z``; ``z`` is overwritten.

    Afterwards ``z`` holds the probabilities ``p`` or, with ``keep_log_probs``, ``log p``.
    """
    _log_softmax_(z)
    logps = z.gather(1, labels[:, None]).squeeze(1)
    entropy = None
    if need_entropy:
        entropy = torch.empty_like(logps)
        for r0 in range(0, z.shape[0], ROW_BLOCK):
            blk = z[r0 : r0 + ROW_BLOCK]
            p = torch.exp(blk)
            entropy[r0 : r0 + ROW_BLOCK] = -torch.bmm(p.unsqueeze(1), blk.unsqueeze(2)).reshape(-1)
            if not keep_log_probs:
                blk.copy_(p)
    elif not keep_log_probs:
        z.exp_()
    return TileStats(logps=logps, entropy=entropy)


def explicit_logit_grad(
    z: torch.Tensor, stats: TileStats, g: torch.Tensor, g_entropy: torch.Tensor | None, log_probs: bool
) -> None:
    """Overwrite ``z`` with the dense part of dL/dz (everything but ``g * onehot``), in place.

    ``z`` holds ``p`` (``log_probs=False``) or ``log p`` (needed for the entropy gradient
    dH/dz_j = -p_j (log p_j + H)).
    """
    if not log_probs:
        z.mul_((-g)[:, None])
        return
    h = g_entropy if g_entropy is not None else torch.zeros_like(g)
    alpha = -g - h * stats.entropy
    for r0 in range(0, z.shape[0], ROW_BLOCK):
        sl = slice(r0, r0 + ROW_BLOCK)
        blk = z[sl]
        p = torch.exp(blk)
        blk.mul_(-h[sl, None]).add_(alpha[sl, None]).mul_(p)


@dataclass
class GradBuffers:
    hidden: torch.Tensor | None  # [N, H] accumulation dtype
    weight: torch.Tensor | None  # [V, H], uninitialised until the first tile writes it
    bias: torch.Tensor | None  # [V]
    weight_written: bool = False


def apply_tile_grads(
    grads: GradBuffers,
    dense: torch.Tensor,
    row_scale: torch.Tensor | None,
    onehot_coef: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_index: torch.Tensor | slice,
    low_precision_buffer: torch.Tensor | None,
) -> None:
    """Accumulate one tile's gradients: dL/dlogits = diag(row_scale) dense + onehot_coef * onehot(labels).

    ``dense`` is E (with ``row_scale``) or the explicit dense part (``row_scale=None``);
    ``onehot_coef`` is ``g / T``. Everything already includes the 1/temperature factor.
    """
    acc = dense.dtype
    if low_precision_buffer is not None:
        low_precision_buffer.copy_(dense)
        gemm_dense = low_precision_buffer
    else:
        gemm_dense = dense
    if grads.hidden is not None:
        gh = gemm_dense @ weight  # [n, H]
        gh = gh.to(acc) if gh.dtype != acc else gh
        if row_scale is not None:
            gh.mul_(row_scale[:, None])
        gh.addcmul_(onehot_coef[:, None], weight.index_select(0, labels).to(acc))
        if isinstance(token_index, slice):
            grads.hidden[token_index] = gh
        else:
            grads.hidden.index_copy_(0, token_index, gh)
    if grads.weight is not None:
        h_acc = hidden.to(acc)
        scaled = h_acc if row_scale is None else h_acc * row_scale[:, None]
        first = not grads.weight_written  # the first tile overwrites: no zero-fill pass over [V, H]
        if low_precision_buffer is None:
            grads.weight.addmm_(gemm_dense.t(), scaled, beta=0 if first else 1)
        elif first:
            grads.weight.copy_(gemm_dense.t() @ scaled.to(hidden.dtype))
        else:
            grads.weight.add_(gemm_dense.t() @ scaled.to(hidden.dtype))
        grads.weight_written = True
        grads.weight.index_add_(0, labels, h_acc * onehot_coef[:, None])
    if grads.bias is not None:
        if row_scale is None:
            grads.bias.add_(dense.sum(0))
        else:
            grads.bias.addmv_(dense.t(), row_scale)
        grads.bias.index_add_(0, labels, onehot_coef)
