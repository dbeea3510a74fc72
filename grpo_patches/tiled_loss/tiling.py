"""Tile size from a memory budget, and tile boundaries (whole rows when the objective needs them)."""

from __future__ import annotations

import torch

from grpo_patches.tiled_loss.options import LossOptions

#: Below this many tokens per tile the grad-weight GEMM (K = tile) gets inefficient.
MIN_TILE = 16
#: Default cap: past ~512 tokens the GEMMs are already efficient, so a bigger tile only costs
#: memory (measured on CPU at V=151936: 512 vs 820 tokens, same time; at V=32000 512 was faster).
MAX_DEFAULT_TILE = 512


def choose_tile_size(n_tokens: int, vocab: int, opts: LossOptions) -> int:
    """Tokens per tile of the torch path: ``tile_size`` if given, else the most that fit
    ``tile_memory_bytes`` of fp32 logits, at most :data:`MAX_DEFAULT_TILE` (the CUDA fold's shape:
    :func:`~grpo_patches.tiled_loss.fold.fold_tokens`, :func:`~grpo_patches.tiled_loss.fold.vocab_chunk`)."""
    if opts.tile_size is not None:
        return max(1, min(opts.tile_size, max(n_tokens, 1)))
    fit = min(opts.tile_memory_bytes // (4 * max(vocab, 1)), MAX_DEFAULT_TILE)
    return max(1, min(max(fit, MIN_TILE), max(n_tokens, 1)))


def tile_bounds(n_tokens: int, tile: int, rows: torch.Tensor | None) -> list[tuple[int, int]]:
    """``[start, end)`` ranges over ``n_tokens`` selected tokens.

    With ``rows`` (the sorted row id of each selected token) every tile holds whole rows:
    rows are packed greedily up to ``tile`` tokens, and a row longer than ``tile`` gets a
    tile of its own (its logits then take ``row_length * vocab`` floats).
    """
    if n_tokens == 0:
        return []
    if rows is None:
        # equal tiles (4096 tokens at 882 -> 5 x 820, not 4 x 882 + 568): no small, inefficient GEMM at the end
        count = -(-n_tokens // tile)
        edges = [round(i * n_tokens / count) for i in range(count + 1)]
        return list(zip(edges[:-1], edges[1:]))
    # boundaries between rows among the selected tokens
    change = torch.nonzero(rows[1:] != rows[:-1]).flatten().add_(1).tolist()
    starts = [0] + change
    ends = change + [n_tokens]
    bounds: list[tuple[int, int]] = []
    cur_start, cur_end = starts[0], ends[0]
    for s, e in zip(starts[1:], ends[1:]):
        if e - cur_start <= tile:
            cur_end = e
        else:
            bounds.append((cur_start, cur_end))
            cur_start, cur_end = s, e
    bounds.append((cur_start, cur_end))
    return bounds
