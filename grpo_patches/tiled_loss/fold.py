"""The fused fold: token tiles x vocabulary chunks, one Triton pass per chunk (CUDA's path).

Per tile of many tokens (4096 by default), two sweeps over vocabulary chunks sized from
``tile_memory_bytes``:

1. *statistics*: the chunk's raw outputs ``r = h W_c^T`` (one GEMM into an fp32 buffer: bf16
   operands, fp32 result), then one kernel pass keeps fp32 running max / sum-exp / entropy term and
   the label's logit (:mod:`~grpo_patches.tiled_loss.fold_kernels`). After the last chunk every
   token has its log-prob and entropy, so the objective gives each token's gradient coefficient.
2. *gradients*: each chunk again (the last one is still in the buffer, so a one-chunk vocabulary is
   never recomputed), one kernel pass writes ``dL/dr`` over it in place (bf16 for bf16 inputs,
   rounded once with the one-hot term folded in), then the hidden gradient accumulates in fp32 and
   the chunk's weight-gradient rows are written (first tile) or accumulated once per token tile.

The logits buffer holds fp32, not bf16: rounding the logits to bf16 before the softmax puts the
bf16 gradient at ~2x its floor (``benchmarks/bf16_grad_error.py``: 3.4e-3 vs 1.7e-3), and the
exactness contract is the floor. The torch path (:mod:`~grpo_patches.tiled_loss.tile_math`) stays
for CPU, fp64 and wherever Triton is not installed; ``GRPO_PATCHES_TILED_KERNEL`` picks a path.
"""

from __future__ import annotations

import functools
import os

import torch

from grpo_patches.errors import OptionError
from grpo_patches.tiled_loss.gemm import addmm_fp32_, mm_fp32
from grpo_patches.tiled_loss.options import LossOptions
from grpo_patches.tiled_loss.tile_math import GradBuffers, TileStats

#: environment variable choosing the tile path: "auto" (the fold on CUDA when Triton imports),
#: "triton" (the fold; off CUDA only under TRITON_INTERPRET=1) or "torch"
KERNEL_ENV = "GRPO_PATCHES_TILED_KERNEL"
#: default tokens per tile of the fold (TRL's token chunk): large GEMMs, the weight gradient
#: touched once per 4096 tokens
FOLD_TOKENS = 4096
#: vocabulary chunks are multiples of this many columns (at least one)
CHUNK_ALIGN = 128


@functools.lru_cache(maxsize=None)
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def fold_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the tile loop runs the fused fold for inputs on ``device`` of ``dtype``.

    fp64 (gradcheck) always takes the torch path: the kernels keep fp32 statistics.
    """
    choice = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if choice not in ("auto", "triton", "torch"):
        raise OptionError(f"{KERNEL_ENV}={choice!r} is not supported; use 'auto', 'triton' or 'torch'")
    if choice == "torch" or dtype == torch.float64:
        return False
    if choice == "auto":
        return device.type == "cuda" and _triton_imports()
    if not _triton_imports():
        raise OptionError(f"{KERNEL_ENV}=triton needs Triton: pip install triton (or set {KERNEL_ENV}=auto)")
    if device.type != "cuda" and not _interpreting():
        raise OptionError(
            f"{KERNEL_ENV}=triton on {device.type} tensors needs TRITON_INTERPRET=1 (Triton's CPU interpreter, "
            "for tests) or CUDA tensors"
        )
    return True


def fold_tokens(n_tokens: int, opts: LossOptions) -> int:
    """Tokens per tile: ``tile_size`` if given, else :data:`FOLD_TOKENS` (at most the tokens there are)."""
    return max(1, min(opts.tile_size or FOLD_TOKENS, max(n_tokens, 1)))


def vocab_chunk(rows: int, vocab: int, opts: LossOptions) -> int:
    """Columns per chunk: as many fp32 columns of ``rows`` tokens as fit ``tile_memory_bytes``."""
    fit = opts.tile_memory_bytes // (4 * max(rows, 1)) // CHUNK_ALIGN * CHUNK_ALIGN
    return max(1, min(vocab, max(fit, CHUNK_ALIGN)))


def _merge(state: tuple | None, part: tuple) -> tuple:
    """Merge per-split partial statistics ``(m, s, t, zy)`` (``[k, n]``) into the running ``[n]`` state."""
    pm, ps, pt, pzy = part
    top = pm.max(0).values if state is None else torch.maximum(pm.max(0).values, state[0])
    w = torch.exp(pm - top)
    s = (w * ps).sum(0)
    t = None if pt is None else (w * (pt + (pm - top) * ps)).sum(0)  # re-centred on the new max
    zy = pzy.sum(0)
    if state is not None:
        m0, s0, t0, zy0 = state
        a = torch.exp(m0 - top)
        s += a * s0
        if t is not None:
            t += a * (t0 + (m0 - top) * s0)
        zy += zy0
    return top, s, t, zy


class Fold:
    """The fold's buffer and chunks for one call (tiles of at most ``max_rows`` tokens)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, opts: LossOptions, max_rows: int) -> None:
        from grpo_patches.tiled_loss import fold_kernels  # Triton is imported only here

        self.kernels = fold_kernels
        self.weight = weight
        self.bias = None if bias is None else bias.detach().float()
        self.opts = opts
        vocab = weight.shape[0]
        chunk = vocab_chunk(max_rows, vocab, opts)
        self.chunks = [(c0, min(c0 + chunk, vocab)) for c0 in range(0, vocab, chunk)]
        self.buffer = torch.empty(max_rows * chunk, dtype=torch.float32, device=weight.device)
        self.own_rows: torch.Tensor | None = None  # a narrow gradient buffer, when in place cannot be
        self.held: tuple | None = None  # (chunk index, tile) whose raw outputs the buffer still holds

    def _raw(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """The chunk's raw outputs ``hidden @ W_c^T`` ([n, Vc] fp32), from the buffer when it holds them."""
        c0, c1 = self.chunks[i]
        x = self.buffer[: hidden.shape[0] * (c1 - c0)].view(hidden.shape[0], c1 - c0)
        if self.held is None or self.held[0] != i or self.held[1] is not hidden:
            mm_fp32(hidden, self.weight[c0:c1].t(), out=x)
        self.held = None
        return x

    def skip_pays(self, kept: int, rows: int) -> bool:
        """Whether leaving out the rows without gradient saves GEMM work: the kept rows need every
        chunk recomputed (the held one holds all rows), the whole tile all but the held one.
        Counted in [rows, chunk] GEMMs: 3 c kept against (3 c - 1) rows for c chunks."""
        c = len(self.chunks)
        return 3 * c * kept < (3 * c - 1) * rows

    def _bias(self, i: int) -> torch.Tensor | None:
        return None if self.bias is None else self.bias[self.chunks[i][0] : self.chunks[i][1]]

    def stats(self, hidden: torch.Tensor, labels: torch.Tensor, need_entropy: bool) -> TileStats:
        """Log-prob of each label (and entropy) of a tile: one GEMM and one kernel pass per chunk."""
        state = None
        for i, (c0, _) in enumerate(self.chunks):
            x = self._raw(i, hidden)
            state = _merge(state, self.kernels.chunk_stats(x, self._bias(i), labels, c0, self.opts, need_entropy))
        self.held = (len(self.chunks) - 1, hidden)
        m, s, t, zy = state
        log_s = torch.log(s)
        lse = m + log_s
        entropy = None if t is None else log_s - t / s
        return TileStats(logps=zy - lse, entropy=entropy, lse=lse)

    def _grad_out(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Where the chunk's ``dL/dr`` goes: over ``x`` (same dtype, or the front of each fp32 row)."""
        if dtype == x.dtype:
            return x
        n, cols = x.shape
        if not self.kernels.grad_needs_own_rows(x, dtype):
            return x.view(dtype)[:, :cols]  # row r's narrow values start where its fp32 values did
        if self.own_rows is None or self.own_rows.numel() < n * cols:
            self.own_rows = torch.empty(self.buffer.numel(), dtype=dtype, device=x.device)
        return self.own_rows[: n * cols].view(n, cols)

    def apply_grads(
        self,
        grads: GradBuffers,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        stats: TileStats,
        g: torch.Tensor,
        g_entropy: torch.Tensor | None,
        token_index: torch.Tensor | slice,
    ) -> None:
        """Accumulate the tile's gradients, chunk by chunk from the last (still held) to the first.

        ``hidden`` may be the tile's rows with a gradient only (a new tensor): every chunk is then
        recomputed, for those rows only."""
        gh = None if grads.hidden is None else torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device)
        first_tile = not grads.weight_written
        g, lse = g.float().contiguous(), stats.lse.contiguous()
        entropy = None if g_entropy is None else stats.entropy.contiguous()
        g_entropy = None if g_entropy is None else g_entropy.float().contiguous()
        for k, i in enumerate(reversed(range(len(self.chunks)))):
            c0, c1 = self.chunks[i]
            x = self._raw(i, hidden)
            d = self._grad_out(x, hidden.dtype)
            self.kernels.chunk_logit_grad_(x, d, self._bias(i), labels, c0, lse, g, entropy, g_entropy, self.opts)
            w = self.weight[c0:c1]
            if gh is not None:
                addmm_fp32_(gh, d, w, beta=0 if k == 0 else 1)
            if grads.weight is not None:
                addmm_fp32_(grads.weight[c0:c1], d.t(), hidden, beta=0 if first_tile else 1)
            if grads.bias is not None:
                grads.bias[c0:c1] += d.sum(0, dtype=torch.float32)
        grads.weight_written = True
        if gh is not None:
            if isinstance(token_index, slice):
                grads.hidden[token_index] = gh
            else:
                grads.hidden.index_copy_(0, token_index, gh)
