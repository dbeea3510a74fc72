"""Kept and dropped rows put back together, and row counts rounded up: what every adapter's
zero-advantage filter needs once it has run the kept rows (and maybe the dropped ones) apart.

The filter runs a micro-batch's kept rows with autograd and, where a metric needs them, the
dropped rows without; the framework's loss then reads ``[rows, ...]`` outputs of the whole
micro-batch, so its denominators stay its own. :func:`merge_rows` builds those outputs, padded
or jagged (a nested tensor of rows of different lengths). :func:`round_up` is the one rule for
"a multiple of" (data-parallel dispatch, static micro-batches, tile widths).
Framework-free; torch is imported when a function runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["merge_rows", "round_up"]


def round_up(count: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` (at least 1) that is ``>= count``."""
    multiple = max(int(multiple), 1)
    return -(-int(count) // multiple) * multiple


def merge_rows(kept: Any, keep: "torch.Tensor", rows: int, *, dropped: Any = None,
               drop: "torch.Tensor | None" = None, fill: Any = None) -> Any:
    """The ``[rows, ...]`` tensor whose rows ``keep`` are ``kept``'s (gradients flow through
    them) and whose other rows are constants: ``dropped``'s at ``drop`` when given, else
    ``fill``'s rows (e.g. their old log-probs), else zeros.

    A non-tensor ``kept`` (``None``, a scalar) comes back as it is. A jagged nested ``kept``
    (rows of different lengths) gives a jagged nested result, the rows not given empty only if
    ``dropped`` covers them (it must).
    """
    import torch

    if not isinstance(kept, torch.Tensor):
        return kept
    has_dropped = dropped is not None and drop is not None and drop.numel() > 0
    if getattr(kept, "is_nested", False):
        pieces: list = [None] * rows
        for i, row in zip(keep.tolist(), kept.unbind()):
            pieces[i] = row
        if has_dropped:
            for i, row in zip(drop.tolist(), dropped.unbind()):
                pieces[i] = row.to(kept.dtype)
        lengths = torch.tensor([p.shape[0] for p in pieces])
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(kept.device)
        return torch.nested.nested_tensor_from_jagged(torch.cat(pieces), offsets=offsets)
    if fill is not None:
        full = fill.detach().to(device=kept.device, dtype=kept.dtype)
    else:
        full = kept.new_zeros((rows, *kept.shape[1:]))
    if has_dropped:
        full = full.index_put((drop.to(kept.device),), dropped.to(device=kept.device, dtype=kept.dtype))
    return full.index_put((keep.to(kept.device),), kept)
