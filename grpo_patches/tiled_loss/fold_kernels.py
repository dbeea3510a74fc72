"""The two Triton kernels of the fused fold (:mod:`~grpo_patches.tiled_loss.fold`), one pass each.

Both read a chunk ``x`` of raw lm-head outputs ``r = h W_c^T`` (fp32, ``[n, Vc]``) and apply the
logit transforms on the fly: ``z = c(r + b) / T`` with ``c(r) = s r`` or, with a softcap,
``cap tanh(s r / cap)`` (the module docstring of :mod:`~grpo_patches.tiled_loss.tile_math`).

- :func:`chunk_stats`: per row and column split, the running max ``m``, ``s = sum exp(z - m)``,
  ``t = sum exp(z - m) (z - m)`` (entropy: ``H = log s - t / s``, no cancellation of large
  logits) and the label's logit; fp32 whatever ``x`` is.
- :func:`chunk_logit_grad_`: ``dL/dr`` of every element, written over ``x`` (or into ``out``):
  ``(g onehot - p (g + h_e (log p + H))) dz/dr``, the one-hot term folded in before any rounding.

Programs are ``(row, column split)``; a row with few tokens in the tile gets several splits so that
small tiles still fill the device. Under ``TRITON_INTERPRET=1`` (set before Triton is first
imported: it fixes how every ``triton.jit`` function is built) they run on CPU tensors through
Triton's interpreter, which is how CI tests them.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # still importable: the torch path runs (fold.fold_enabled never picks the fold then)
    triton = tl = None


def _jit(fn):
    return fn if triton is None else triton.jit(fn)


#: columns per block of a program's loop (a power of two); the tests lower it to exercise masking
BLOCK = 2048
#: aim for this many programs per streaming multiprocessor before splitting rows into column ranges
PROGRAMS_PER_SM = 4


@_jit
def _logits(x_ptr, stride_x, bias_ptr, row, cols, valid, pre, post, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    """One block of a row: ``(z, dz/dr / chain)``, the logits and the softcap's ``1 - tanh^2`` (1 without).

    tanh in fp32 to ~1e-7 relative, without libdevice (the interpreter has none): an odd Taylor
    series below |x| = 0.25, where ``(1 - e) / (1 + e)`` (``e = exp(-2|x|)``) cancels, that beyond.
    """
    r = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_BIAS:
        r += tl.load(bias_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    if SOFTCAP:
        x = r * pre
        ax = tl.abs(x)
        e = tl.exp(-2.0 * ax)
        x2 = x * x
        near = ax * (1.0 + x2 * (-1.0 / 3 + x2 * (2.0 / 15 + x2 * (-17.0 / 315 + x2 * (62.0 / 2835)))))
        mag = tl.where(ax < 0.25, near, (1.0 - e) / (1.0 + e))
        th = tl.where(x < 0, -mag, mag)
        return th * post, 1.0 - th * th
    return r * pre, tl.full(r.shape, 1.0, tl.float32)


@_jit
def _stats_kernel(x_ptr, stride_x, bias_ptr, labels_ptr, col0, n_cols, split_cols,
                  m_ptr, s_ptr, t_ptr, zy_ptr, n_rows, pre, post,
                  HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, NEED_T: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start = split * split_cols
    end = tl.minimum(start + split_cols, n_cols)
    label = tl.load(labels_ptr + row) - col0
    m = tl.full((), -1e30, tl.float32)  # finite: m - m_new stays finite, times s = 0 is 0
    s = tl.zeros((), tl.float32)
    t = tl.zeros((), tl.float32)
    zy = tl.zeros((), tl.float32)
    for c in range(start, end, BLOCK_V):
        cols = c + tl.arange(0, BLOCK_V)
        valid = cols < end
        z, _ = _logits(x_ptr, stride_x, bias_ptr, row, cols, valid, pre, post, HAS_BIAS, SOFTCAP)
        z = tl.where(valid, z, -float("inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        alpha = tl.exp(m - m_new)
        e = tl.exp(z - m_new)  # 0 at invalid columns
        if NEED_T:
            t = alpha * (t + (m - m_new) * s) + tl.sum(e * tl.where(valid, z - m_new, 0.0), axis=0)
        s = alpha * s + tl.sum(e, axis=0)
        zy += tl.sum(tl.where(cols == label, z, 0.0), axis=0)
        m = m_new
    out = split * n_rows + row
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, s)
    tl.store(zy_ptr + out, zy)
    if NEED_T:
        tl.store(t_ptr + out, t)


@_jit
def _grad_kernel(x_ptr, stride_x, out_ptr, stride_out, bias_ptr, labels_ptr, col0, n_cols, split_cols,
                 lse_ptr, g_ptr, ent_ptr, ge_ptr, pre, post, chain,
                 HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, OUT_BF16: tl.constexpr,
                 BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start = split * split_cols
    end = tl.minimum(start + split_cols, n_cols)
    label = tl.load(labels_ptr + row) - col0
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row)
    if ENTROPY:
        h_e = tl.load(ge_ptr + row)
        ent = tl.load(ent_ptr + row)
    for c in range(start, end, BLOCK_V):
        cols = c + tl.arange(0, BLOCK_V)
        valid = cols < end
        z, dtanh = _logits(x_ptr, stride_x, bias_ptr, row, cols, valid, pre, post, HAS_BIAS, SOFTCAP)
        log_p = z - lse
        p = tl.exp(log_p)
        coef = g
        if ENTROPY:
            coef = g + h_e * (log_p + ent)  # dH/dz_j = -p_j (log p_j + H)
        d = tl.where(cols == label, g, 0.0) - p * coef
        d = d * (dtanh * chain)
        if OUT_BF16:  # round to nearest even by hand: Triton's interpreter truncates a plain .to(bfloat16)
            bits = d.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            tl.store(out_ptr + row * stride_out + cols, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=valid)
        else:
            tl.store(out_ptr + row * stride_out + cols, d.to(out_ptr.dtype.element_ty), mask=valid)


def _splits(n_rows: int, n_cols: int, device: torch.device) -> tuple[int, int, int]:
    """``(splits, split_cols, block)``: enough programs to fill the device, whole blocks per split."""
    block = min(BLOCK, triton.next_power_of_2(max(n_cols, 16)))
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    blocks = triton.cdiv(n_cols, block)
    splits = max(1, min(blocks, triton.cdiv(PROGRAMS_PER_SM * sms, max(n_rows, 1))))
    split_cols = triton.cdiv(blocks, splits) * block
    return triton.cdiv(n_cols, split_cols), split_cols, block


def _transform_args(opts) -> tuple[float, float, bool]:
    """``(pre, post, softcap)``: ``z = pre * r`` or ``post * tanh(pre * r)``."""
    if opts.logit_softcap is None:
        return opts.logit_scale / opts.temperature, 1.0, False
    return opts.logit_scale / opts.logit_softcap, opts.logit_softcap / opts.temperature, True


def chunk_stats(x: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, col0: int, opts,
                need_entropy: bool) -> tuple[torch.Tensor, ...]:
    """Partial softmax statistics of one chunk: ``(m, s, t, zy)``, each ``[splits, n]`` fp32 (``t``: None
    without entropy; ``zy`` is 0 where the label lies outside the chunk)."""
    n, n_cols = x.shape
    splits, split_cols, block = _splits(n, n_cols, x.device)
    parts = torch.empty(4 if need_entropy else 3, splits, n, dtype=torch.float32, device=x.device)
    m, s, zy = parts[0], parts[1], parts[2]
    t = parts[3] if need_entropy else zy  # an unused pointer without entropy
    pre, post, softcap = _transform_args(opts)
    _stats_kernel[(n, splits)](
        x, x.stride(0), x if bias is None else bias, labels, col0, n_cols, split_cols,
        m, s, t, zy, n, pre, post,
        HAS_BIAS=bias is not None, SOFTCAP=softcap, NEED_T=need_entropy, BLOCK_V=block,
    )
    return m, s, t if need_entropy else None, zy


def grad_needs_own_rows(x: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """True when the gradient cannot overwrite ``x`` in place: a narrower output written by several
    programs per row would overwrite fp32 values another program has not read yet."""
    return out_dtype != x.dtype and _splits(x.shape[0], x.shape[1], x.device)[0] > 1


def chunk_logit_grad_(x: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                      col0: int, lse: torch.Tensor, g: torch.Tensor, entropy: torch.Tensor | None,
                      g_entropy: torch.Tensor | None, opts) -> None:
    """Write ``dL/dr`` of the chunk into ``out`` (``x`` itself, a narrower strided view of ``x``'s rows,
    or a buffer of its own: :func:`grad_needs_own_rows`)."""
    n, n_cols = x.shape
    splits, split_cols, block = _splits(n, n_cols, x.device)
    pre, post, softcap = _transform_args(opts)
    with_entropy = g_entropy is not None
    _grad_kernel[(n, splits)](
        x, x.stride(0), out, out.stride(0), x if bias is None else bias, labels, col0, n_cols, split_cols,
        lse, g, entropy if with_entropy else lse, g_entropy if with_entropy else g, pre, post, opts.logit_chain,
        HAS_BIAS=bias is not None, SOFTCAP=softcap, ENTROPY=with_entropy, OUT_BF16=out.dtype == torch.bfloat16,
        BLOCK_V=block,
    )
