"""The zero-advantage filter: drop rows whose advantage is exactly 0 from the update, exactly.

A row whose unmasked advantages are all exactly ``0.0`` has exactly zero policy-gradient loss
and gradient (every GRPO-style per-token loss is a product with the advantage), so it only
costs compute. Dropping it changes the result only through the aggregation's denominator;
the weights returned here undo that: each kept row's per-token loss is multiplied by its
weight before the framework aggregates the kept rows, which reproduces the full micro-batch's
loss and gradient. Any term that gives such rows a gradient (KL, entropy bonus, aux loss)
makes the filter inexact: :func:`filter_problems` names those settings (and
:func:`require_filter_compatible` refuses them). The filter is framework-free: each adapter
says what its framework's loss divides by (:data:`DENOMINATORS`) and which of its settings
give those rows a gradient.

Data parallel: every rank keeps the same number of rows (the maximum over the group), padding
with its own shortest zero-advantage rows at weight 0; weights count those rows in the
denominators they are part of.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from grpo_patches.errors import IncompatibleOptionsError, OptionError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "DENOMINATORS",
    "GradientTerm",
    "ZeroAdvantageFilter",
    "filter_problems",
    "filter_zero_advantage",
    "require_filter_compatible",
]

#: What the loss of one micro-batch is divided by (each adapter maps its framework's loss
#: modes onto these; the filter needs nothing else):
#: ``tokens``  the micro-batch's unmasked tokens (a token mean over the micro-batch);
#: ``rows``    the micro-batch's rows (a mean over rows of per-row token means or sums);
#: ``fixed``   a number that does not depend on which rows of the micro-batch are present: a
#:             global token/row count computed before filtering, ``num_items_in_batch``, a
#:             constant such as the padded width.
DENOMINATORS: tuple[str, ...] = ("tokens", "rows", "fixed")


@dataclass(frozen=True, eq=False)
class ZeroAdvantageFilter:
    """Which rows of a micro-batch to keep and how to weight them.

    :ivar keep: ``LongTensor [K]`` of kept row indices, ascending (original order).
    :ivar weights: ``[K]`` per-kept-row loss weights (float64 for float64 advantages, else
        float32), ``0`` on padding rows.
    :ivar rows_dropped: rows removed from the micro-batch.
    :ivar tokens_dropped: unmasked tokens of the removed rows.
    :ivar padding_rows: zero-advantage rows kept at weight 0 (to align DP ranks, or because
        every row had a zero advantage: at least one row is always kept).
    :ivar scale: the common weight of the non-padding rows (``0.0`` when every kept row is
        padding), or ``None`` when they differ. Padding rows have exactly zero loss, so an
        adapter may multiply the aggregated loss by ``scale`` instead of applying ``weights``.
    """

    keep: "torch.Tensor"
    weights: "torch.Tensor"
    rows_dropped: int
    tokens_dropped: int
    padding_rows: int
    scale: float | None = field(default=None)

    @property
    def rows_kept(self) -> int:
        return int(self.keep.numel())


def _check_inputs(advantages: "torch.Tensor", mask: "torch.Tensor", denominator: str) -> None:
    if denominator not in DENOMINATORS:
        raise OptionError(f"unknown denominator {denominator!r}; valid ones are: {', '.join(DENOMINATORS)}")
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    if advantages.dim() == 1:
        if advantages.shape[0] != mask.shape[0]:
            raise ValueError(
                f"advantages [B] has B={advantages.shape[0]} but mask is {tuple(mask.shape)}: one advantage per row"
            )
    elif advantages.dim() == 2:
        if advantages.shape != mask.shape:
            raise ValueError(
                f"per-token advantages must have the mask's shape {tuple(mask.shape)}, got {tuple(advantages.shape)}"
            )
    else:
        raise ValueError(f"advantages must be [B] or [B, T], got shape {tuple(advantages.shape)}")


def _max_over_group(count: int, device: "torch.device", group: Any) -> int:
    """The largest ``count`` over the data-parallel group (``count`` itself outside one)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError(
                "group was given but torch.distributed is not initialised; pass group=None for a single process"
            )
        return count
    if "nccl" in str(dist.get_backend(group)) and device.type == "cpu":
        device = torch.device("cuda", torch.cuda.current_device())  # NCCL reduces device tensors only
    value = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return int(value.item())


def filter_zero_advantage(
    advantages: "torch.Tensor", mask: "torch.Tensor", denominator: str, *, group: Any = None
) -> ZeroAdvantageFilter:
    """Choose the rows of one micro-batch to keep, with per-row loss weights.

    A row is kept iff some unmasked token's advantage is ``!= 0.0`` exactly (NaN counts as
    non-zero, so it still propagates). The weight of every kept non-padding row is

    * ``"tokens"``: kept tokens (padding rows included) / all tokens of the micro-batch;
    * ``"rows"``: kept rows (padding rows included) / all rows of the micro-batch;
    * ``"fixed"``: 1.

    :param advantages: ``[B]`` or ``[B, T]`` advantages.
    :param mask: ``[B, T]`` loss mask (non-zero entries enter the loss; token counts use
        ``mask.sum()`` like the frameworks do).
    :param denominator: one of :data:`DENOMINATORS`: what the framework's loss of this
        micro-batch is divided by.
    :param group: the data-parallel process group (``None``: the default group when
        ``torch.distributed`` is initialised). Every rank of it must call this function.
    """
    import torch

    _check_inputs(advantages, mask, denominator)
    with torch.no_grad():
        active = mask != 0
        per_token = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        useful = ((per_token != 0) & active).any(dim=1)
        rows = int(mask.shape[0])
        real = torch.nonzero(useful).flatten().cpu()
        lengths = mask.detach().to(torch.float64).sum(dim=1).cpu()

        # at least one row so backward runs (and DDP's hooks fire); the same count on all ranks
        target = _max_over_group(max(int(real.numel()), 1 if rows else 0), advantages.device, group)
        target = min(target, rows)
        zero_rows = torch.nonzero(~useful).flatten().cpu()
        order = torch.sort(lengths[zero_rows], stable=True).indices  # shortest first, ties by index
        padding = zero_rows[order[: target - real.numel()]]
        keep = torch.sort(torch.cat([real, padding])).values

        if real.numel() == 0:
            scale = 0.0
        elif denominator == "tokens":
            scale = float(lengths[keep].sum()) / float(lengths.sum())
        elif denominator == "rows":
            scale = keep.numel() / rows
        else:
            scale = 1.0
        dtype = torch.float64 if advantages.dtype == torch.float64 else torch.float32
        weights = torch.zeros(keep.numel(), dtype=dtype)
        weights[useful.cpu()[keep]] = scale  # padding rows stay at 0

        dropped = torch.ones(rows, dtype=torch.bool)
        dropped[keep] = False
        tokens_dropped = int(active.cpu()[dropped].sum())
    device = advantages.device
    return ZeroAdvantageFilter(
        keep=keep.to(device=device, dtype=torch.long),
        weights=weights.to(device),
        rows_dropped=rows - int(keep.numel()),
        tokens_dropped=tokens_dropped,
        padding_rows=int(padding.numel()),
        scale=scale,
    )


# ---------------------------------------------------------------------------------------
# settings that give zero-advantage rows a gradient


@dataclass(frozen=True)
class GradientTerm:
    """A framework setting that gives zero-advantage rows a gradient unless it is neutral.

    :ivar setting: the framework's name for it (``"beta"``, ``"actor.entropy_coeff"``).
    :ivar value: its value in this run.
    :ivar term: what it weights, for the message (``"a KL term"``); ``None``: "the term
        weighted by <setting>".
    :ivar neutral: the value that leaves the filter exact (0 for coefficients).
    :ivar why: the whole reason when it is not "<term> gives zero-advantage rows a gradient".
    """

    setting: str
    value: Any
    term: str | None = None
    neutral: float = 0.0
    why: str | None = None


def filter_problems(terms: Iterable[GradientTerm]) -> list[str]:
    """Every setting that gives zero-advantage rows a gradient, each with its value and the
    setting's fix (empty: the filter is exact). For :func:`grpo_patches.refuse_or_note.refuse_or_note`.

    :raises OptionError: a value that is not a number.
    """
    problems = []
    for t in terms:
        if isinstance(t.value, (bool, str, bytes)):
            raise OptionError(f"{t.setting} must be a number, got {t.value!r}")
        try:
            number = float(t.value)
        except (TypeError, ValueError):
            raise OptionError(f"{t.setting} must be a number, got {t.value!r}") from None
        if number == t.neutral:
            continue
        why = t.why or f"{t.term or f'the term weighted by {t.setting}'} gives zero-advantage rows a gradient"
        shown = repr(number) if math.isfinite(number) else str(number)
        problems.append(
            f"the zero-advantage filter needs {t.setting} == {t.neutral:g} (got {shown}): {why}. "
            f"Set {t.setting}={t.neutral:g}"
        )
    return problems


def require_filter_compatible(terms: Iterable[GradientTerm]) -> None:
    """Raise :class:`IncompatibleOptionsError` unless every setting leaves the filter exact.

    Every offending setting is reported at once, each with its value and the fix.

    :raises OptionError: a value that is not a number.
    """
    fix = "or pass zero_advantage_filter=False (or 'auto') to grpo_patches.enable(...)"
    problems = filter_problems(terms)
    if problems:
        raise IncompatibleOptionsError("\n".join(f"{problem}, {fix}" for problem in problems))
