"""The padding columns of a batch that no row uses: what every adapter's padding trim cuts.

Frameworks pad a whole batch to one width (prompts on the left, completions on the right).
Once the zero-advantage filter has chosen the rows that run, the leading and trailing columns
that none of them attends to are pure padding work. This module finds them from a mask; each
adapter decides how much of that span it may cut exactly (positions, the loss's columns,
width multiples) and cuts it with its framework's own tensors: ``adapters/trl/trim.py``,
``adapters/nemo_rl/trim.py``, ``adapters/verl/trim_legacy.py``. Framework-free (torch only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Columns", "used_span"]


@dataclass(frozen=True)
class Columns:
    """The columns cut from one call: ``lead`` leading and ``tail`` trailing ones."""

    lead: int = 0
    tail: int = 0

    @property
    def any(self) -> bool:
        return bool(self.lead or self.tail)

    def tokens(self, rows: int) -> int:
        """Token positions not computed for ``rows`` rows (``grpo_patches/padding_tokens_skipped``)."""
        return rows * (self.lead + self.tail)


def used_span(*masks: "torch.Tensor") -> tuple[int, int] | None:
    """``(first, end)``: the first column some row of ``masks`` marks and one past the last.

    Every mask is ``[rows, width]`` of the same width (non-zero: used); a column is used when
    any row of any mask marks it. ``None`` when no column is used (or there are no rows).
    """
    import torch

    used = None
    for mask in masks:
        if mask is None or mask.numel() == 0:
            continue
        columns = mask.bool().any(dim=0)
        used = columns if used is None else used | columns
    if used is None:
        return None
    marked = torch.nonzero(used).flatten()
    if not marked.numel():
        return None
    return int(marked[0]), int(marked[-1]) + 1
