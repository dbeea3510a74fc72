"""The [tile, vocab] work of one tile: logits, log-softmax statistics, and the gradient GEMMs.

The logits buffer is reused for every tile and modified in place (log-softmax, then exp:
two fused passes). The logits are ``z = c(r) / T`` of the raw lm-head output ``r = h W^T + b``,
with ``c(r) = s r`` or, with a softcap, ``c(r) = cap tanh(s r / cap)`` (``s = logit_scale``).
With ``p = softmax(z)`` and ``g = dL/dlogp``, the gradient w.r.t. ``r`` is
``(g onehot(y) - g p) * k`` (plus an entropy term), ``k = s / T`` times ``1 - tanh^2`` with a
softcap. Without softcap or entropy term, the dense part ``-g k p = diag(-g k) p`` is applied
as a row scale on the small side of the GEMMs (``[tile, H]``), so no extra pass over the logits
is needed; the one-hot part is a gather / index_add of ``tile`` rows. The GEMMs themselves, per
input dtype, are :mod:`~grpo_patches.tiled_loss.gemm`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_patches.tiled_loss.gemm import LmHead
from grpo_patches.tiled_loss.options import LossOptions

#: Rows per block of the optional entropy passes (32 x 151936 fp32 = 19 MB of scratch).
ROW_BLOCK = 32


@dataclass
class TileStats:
    logps: torch.Tensor  # [n] log-prob of each label
    entropy: torch.Tensor | None  # [n]
    lse: torch.Tensor | None = None  # [n] log-sum-exp of each row's logits (softcap: the buffer keeps tanh)
    label_tanh: torch.Tensor | None = None  # [n] the softcap's tanh at each label (same case)

    def rows(self, keep: torch.Tensor) -> "TileStats":
        """The statistics of the rows ``keep``."""
        return TileStats(*(None if v is None else v[keep] for v in (self.logps, self.entropy, self.lse,
                                                                      self.label_tanh)))


def rows_with_gradient(g: torch.Tensor, g_entropy: torch.Tensor | None) -> torch.Tensor | None:
    """The rows whose logits gradient is not exactly 0 (``None``: every row), e.g. tokens whose ratio
    is clipped, masked by ``policy_token_mask`` or at advantage 0. The others leave the gradient GEMMs:
    their rows of ``dL/dr`` are ``0 * (onehot - p)``, exactly 0."""
    nonzero = g != 0 if g_entropy is None else (g != 0) | (g_entropy != 0)
    keep = torch.nonzero(nonzero).flatten()
    return None if keep.numel() == g.numel() else keep


def compact_rows_(z: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Move rows ``keep`` (ascending) of ``z`` to its front in place; returns ``z[:len(keep)]``.

    In place, with no copy of the tile: row ``keep[j] >= j`` is read before any later row is written.
    """
    moved = (keep != torch.arange(keep.numel(), device=keep.device)).nonzero()
    if moved.numel():
        for j in range(int(moved[0]), keep.numel()):
            z[j].copy_(z[int(keep[j])])
    return z[: keep.numel()]


def compute_logits(out: torch.Tensor, hidden: torch.Tensor, head: LmHead, opts: LossOptions, keep_tanh: bool) -> None:
    """``out[:] = c(hidden @ W.T + b) / T`` (module docstring) in out's (accumulation) dtype.

    With a softcap and ``keep_tanh``, ``out`` holds ``tanh(s r / cap)`` instead (the logits are
    that times ``cap / T``): the gradient's ``1 - tanh^2`` is then exact, where recovering tanh
    from rounded logits loses ulps that ``1 / (1 - tanh^2)`` amplifies at saturated logits.
    """
    if opts.logit_softcap is None:
        head.logits(out, hidden, opts.logit_scale / opts.temperature)
        return
    cap = opts.logit_softcap
    head.logits(out, hidden, opts.logit_scale / cap)
    out.tanh_()
    if not keep_tanh:
        out.mul_(cap / opts.temperature)


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


def _stats_from_tanh(t: torch.Tensor, labels: torch.Tensor, need_entropy: bool, opts: LossOptions) -> TileStats:
    """Statistics of the logits ``t * cap / T`` without overwriting ``t`` (``ROW_BLOCK x V`` of scratch)."""
    to_logit = opts.logit_softcap / opts.temperature
    lse = torch.empty(t.shape[0], dtype=t.dtype, device=t.device)
    entropy = torch.empty_like(lse) if need_entropy else None
    for r0 in range(0, t.shape[0], ROW_BLOCK):
        sl = slice(r0, r0 + ROW_BLOCK)
        z = t[sl] * to_logit
        lse[sl] = torch.logsumexp(z, 1)
        if need_entropy:
            log_p = z.sub_(lse[sl, None])
            entropy[sl] = -torch.bmm(torch.exp(log_p).unsqueeze(1), log_p.unsqueeze(2)).reshape(-1)
    label_tanh = t.gather(1, labels[:, None]).squeeze(1)
    return TileStats(logps=label_tanh * to_logit - lse, entropy=entropy, lse=lse, label_tanh=label_tanh)


def softmax_stats(
    z: torch.Tensor, labels: torch.Tensor, need_entropy: bool, opts: LossOptions, leave: str = "probs"
) -> TileStats:
    """Log-prob of the labels (and entropy) of logits ``z``, leaving ``z`` holding ``leave``.

    ``leave``: ``"probs"`` (``p``), ``"log_probs"`` (``log p``), ``"any"`` (cheapest: no
    gradient follows) or ``"tanh"``: ``z`` held the softcap's tanh (:func:`compute_logits`
    with ``keep_tanh``) and keeps it; the stats then carry each row's log-sum-exp.
    """
    if leave == "tanh":
        return _stats_from_tanh(z, labels, need_entropy, opts)
    _log_softmax_(z)
    logps = z.gather(1, labels[:, None]).squeeze(1)
    entropy = None
    if need_entropy:
        entropy = torch.empty_like(logps)
        for r0 in range(0, z.shape[0], ROW_BLOCK):
            blk = z[r0 : r0 + ROW_BLOCK]
            p = torch.exp(blk)
            entropy[r0 : r0 + ROW_BLOCK] = -torch.bmm(p.unsqueeze(1), blk.unsqueeze(2)).reshape(-1)
            if leave == "probs":
                blk.copy_(p)
    elif leave == "probs":
        z.exp_()
    return TileStats(logps=logps, entropy=entropy)


def label_chain(stats: TileStats, opts: LossOptions) -> torch.Tensor | float:
    """d z_y / d r_y of each row's label: ``s / T``, times ``1 - tanh^2`` at the label with a softcap."""
    if opts.logit_softcap is None:
        return opts.logit_chain
    return opts.logit_chain * (1 - stats.label_tanh * stats.label_tanh)


def explicit_logit_grad(
    z: torch.Tensor, stats: TileStats, g: torch.Tensor, g_entropy: torch.Tensor | None, holds: str, opts: LossOptions
) -> None:
    """Overwrite ``z`` with the dense part of dL/dr (everything but the one-hot term), in place.

    ``z`` holds (``holds``) ``"probs"`` (no entropy term, no softcap), ``"log_probs"`` (the
    entropy gradient dH/dz_j = -p_j (log p_j + H) needs them) or, with a softcap, ``"tanh"``
    (``log p = tanh * cap / T - lse``, and the chain factor ``1 - tanh^2``).
    """
    chain = opts.logit_chain
    if holds == "probs":
        z.mul_((-g * chain)[:, None])
        return
    h = (g_entropy if g_entropy is not None else torch.zeros_like(g)) * chain
    alpha = -g * chain if stats.entropy is None else (-g * chain - h * stats.entropy)
    for r0 in range(0, z.shape[0], ROW_BLOCK):
        sl = slice(r0, r0 + ROW_BLOCK)
        blk = z[sl]
        if holds == "tanh":
            dtanh = torch.mul(blk, blk).neg_().add_(1)  # 1 - tanh^2
            blk.mul_(opts.logit_softcap / opts.temperature).sub_(stats.lse[sl, None])  # log p
            p = torch.exp(blk).mul_(dtanh)
        else:
            p = torch.exp(blk)
        blk.mul_(-h[sl, None]).add_(alpha[sl, None]).mul_(p)


@dataclass
class GradBuffers:
    hidden: torch.Tensor | None  # [N, H] accumulation dtype
    weight: torch.Tensor | None  # [V, H], uninitialised until the first tile writes it
    bias: torch.Tensor | None  # [V]
    weight_written: bool = False


def fold_onehot_(dense: torch.Tensor, labels: torch.Tensor, onehot_coef: torch.Tensor) -> None:
    """Add the one-hot term into the dense gradient (before it is rounded to a low-precision GEMM operand)."""
    dense.scatter_add_(1, labels[:, None], onehot_coef[:, None].to(dense.dtype))


def apply_tile_grads(
    grads: GradBuffers,
    head: LmHead,
    dense: torch.Tensor,
    dense_lp: torch.Tensor | None,
    row_scale: torch.Tensor | None,
    onehot_coef: torch.Tensor | None,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    token_index: torch.Tensor | slice,
) -> None:
    """Accumulate one tile's gradients: dL/dr = diag(row_scale) dense + onehot_coef * onehot(labels).

    ``dense`` is E (with ``row_scale``) or the explicit dense part (``row_scale=None``);
    ``onehot_coef`` is ``g`` times the label's chain factor, ``None`` once folded into ``dense``
    (then ``dense_lp`` is ``dense`` rounded to the input dtype, the GEMM operand).
    """
    acc = dense.dtype
    if grads.hidden is not None:
        gh = head.grad_hidden(dense, dense_lp)  # [n, H]
        if row_scale is not None:
            gh.mul_(row_scale[:, None])
        if onehot_coef is not None:
            gh.addcmul_(onehot_coef[:, None], head.weight.index_select(0, labels).to(acc))
        if isinstance(token_index, slice):
            grads.hidden[token_index] = gh
        else:
            grads.hidden.index_copy_(0, token_index, gh)
    if grads.weight is not None:
        first = not grads.weight_written  # the first tile overwrites: no zero-fill pass over [V, H]
        if dense_lp is not None:
            head.grad_weight_(grads.weight, dense, dense_lp, hidden, first)
        else:
            h_acc = hidden.to(acc)
            scaled = h_acc if row_scale is None else h_acc * row_scale[:, None]
            head.grad_weight_(grads.weight, dense, None, scaled, first)
        grads.weight_written = True
        if onehot_coef is not None:
            grads.weight.index_add_(0, labels, hidden.to(acc) * onehot_coef[:, None])
    if grads.bias is not None:
        if row_scale is None:
            grads.bias.add_(dense.sum(0))
        else:
            grads.bias.addmv_(dense.t(), row_scale)
        if onehot_coef is not None:
            grads.bias.index_add_(0, labels, onehot_coef)
