"""The zero-advantage filter: drop rows whose advantage is exactly 0 from the update, exactly.

A row whose unmasked advantages are all exactly ``0.0`` has exactly zero policy-gradient loss
and gradient (every GRPO-style per-token loss is a product with the advantage), so it only
costs compute. Dropping it changes the result only through the aggregation's denominator;
the weights returned here undo that: each kept row's per-token loss is multiplied by its
weight before the framework aggregates the kept rows, which reproduces the full micro-batch's
loss and gradient. Any term that gives such rows a gradient (KL, entropy bonus, aux loss)
makes the filter inexact: :func:`require_filter_compatible` refuses those settings.

Data parallel: every rank keeps the same number of rows (the maximum over the group), padding
with its own shortest zero-advantage rows at weight 0; weights count those rows in the
denominators they are part of.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grpo_patches.errors import IncompatibleOptionsError, OptionError, UnknownFrameworkError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "AGGREGATIONS",
    "ZeroAdvantageFilter",
    "aggregation_for",
    "filter_zero_advantage",
    "require_filter_compatible",
]

#: How the framework turns per-token losses of one micro-batch into the loss, by denominator:
#: ``token-mean``          sum of masked token losses / masked tokens of the micro-batch;
#: ``seq-mean-token-mean`` mean over the micro-batch's rows of each row's masked token mean;
#: ``seq-mean-token-sum``  mean over the micro-batch's rows of each row's masked token sum
#:                         (times any constant, e.g. Dr. GRPO's 1 / max_completion_length);
#: ``fixed-denominator``   a sum (of token losses or row means) divided by a number that does
#:                         not depend on which rows of the micro-batch are present: a global
#:                         token/row count computed before filtering, ``num_items_in_batch``,
#:                         a constant such as the padded width.
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "fixed-denominator")

_ROW_MEANS = ("seq-mean-token-mean", "seq-mean-token-sum")


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


def _check_inputs(advantages: "torch.Tensor", mask: "torch.Tensor", aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise OptionError(f"unknown aggregation {aggregation!r}; valid ones are: {', '.join(AGGREGATIONS)}")
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
    advantages: "torch.Tensor", mask: "torch.Tensor", aggregation: str, *, group: Any = None
) -> ZeroAdvantageFilter:
    """Choose the rows of one micro-batch to keep, with per-row loss weights.

    A row is kept iff some unmasked token's advantage is ``!= 0.0`` exactly (NaN counts as
    non-zero, so it still propagates). The weight of every kept non-padding row is

    * ``token-mean``: kept tokens (padding rows included) / all tokens of the micro-batch;
    * ``seq-mean-*``: kept rows (padding rows included) / all rows of the micro-batch;
    * ``fixed-denominator``: 1.

    :param advantages: ``[B]`` or ``[B, T]`` advantages.
    :param mask: ``[B, T]`` loss mask (non-zero entries enter the loss; token counts use
        ``mask.sum()`` like the frameworks do).
    :param aggregation: one of :data:`AGGREGATIONS` (see :func:`aggregation_for`).
    :param group: the data-parallel process group (``None``: the default group when
        ``torch.distributed`` is initialised). Every rank of it must call this function.
    """
    import torch

    _check_inputs(advantages, mask, aggregation)
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
        elif aggregation == "token-mean":
            scale = float(lengths[keep].sum()) / float(lengths.sum())
        elif aggregation in _ROW_MEANS:
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
# framework loss modes -> aggregation

#: TRL 1.16 ``loss_type`` -> aggregation (GRPOTrainer._compute_loss); the extra division by
#: ``current_gradient_accumulation_steps`` is the same for every micro-batch, so it is fixed.
_TRL = {
    "grpo": "seq-mean-token-mean",  # per-row token mean, mean over local rows
    "sapo": "seq-mean-token-mean",
    "bnpo": "token-mean",  # / local masked tokens
    "dr_grpo": "seq-mean-token-sum",  # / (local rows * max_completion_length)
    "luspo": "seq-mean-token-sum",  # per-row token sum, mean over local rows
    "dapo": "fixed-denominator",  # / (num_items_in_batch / processes * GA / spg)
    "cispo": "fixed-denominator",
    "vespo": "fixed-denominator",
}
#: verl dp_actor (<= 0.7.x): agg_loss denominators are per micro-batch.
_VERL_LOCAL = {
    "token-mean": "token-mean",
    "seq-mean-token-mean": "seq-mean-token-mean",
    "seq-mean-token-sum": "seq-mean-token-sum",
    "seq-mean-token-sum-norm": "fixed-denominator",  # / padded width or loss_scale_factor
}
#: verl >= 0.8 engine ppo_loss: global token counts / global_batch_size, fixed per micro-batch.
_VERL_GLOBAL = dict.fromkeys(_VERL_LOCAL, "fixed-denominator")
#: NeMo-RL ClippedPGLossFn: / global_valid_toks (token level) or global_valid_seqs (sequence).
_NEMO_RL = dict.fromkeys(("token", "token-level", "sequence", "sequence-level"), "fixed-denominator")

_FRAMEWORKS = ("trl", "verl", "nemo_rl")


def aggregation_for(framework: str, mode: str, *, version: str | None = None) -> str:
    """The :data:`AGGREGATIONS` name of a framework's loss mode.

    :param framework: ``"trl"`` (``loss_type``; read from TRL 1.16), ``"verl"``
        (``actor.loss_agg_mode``) or ``"nemo_rl"`` (``"token"`` / ``"sequence"`` for
        ``loss_fn.token_level_loss`` true / false; ``"nemo-rl"`` is accepted too).
    :param mode: the framework's name of its loss normalisation.
    :param version: required for verl, whose denominators are per micro-batch up to 0.7
        (dp_actor) and global from 0.8 (engine ``ppo_loss``).

    Outer factors that count a micro-batch's rows (verl <= 0.7 ``use_dynamic_bsz`` scales
    the loss by ``rows / ppo_mini_batch_size``) and global normalisers must be computed
    from the unfiltered micro-batch; the filter's weights do not include them.
    """
    name = "nemo_rl" if framework == "nemo-rl" else framework
    if name == "trl":
        table = _TRL
    elif name == "nemo_rl":
        table = _NEMO_RL
    elif name == "verl":
        if version is None:
            raise OptionError(
                "aggregation_for('verl', ...) needs version=: verl's denominators are per micro-batch "
                "up to 0.7 and global from 0.8; pass version=verl.__version__"
            )
        from packaging.version import Version

        table = _VERL_LOCAL if Version(version) < Version("0.8.0.dev0") else _VERL_GLOBAL
    else:
        raise UnknownFrameworkError(f"unknown framework {framework!r}; valid names are: {', '.join(_FRAMEWORKS)}")
    if mode not in table:
        raise OptionError(f"unknown {name} loss mode {mode!r}; valid ones are: {', '.join(table)}")
    return table[mode]


# ---------------------------------------------------------------------------------------
# settings that give zero-advantage rows a gradient

#: coefficient name -> the term it weights (any other name gets a generic description).
_TERMS = {
    "beta": "a KL term",
    "kl_loss_coef": "a KL loss",
    "kl_coef": "a KL term",
    "reference_policy_kl_penalty": "a KL penalty",
    "entropy_coef": "an entropy bonus",
    "entropy_coeff": "an entropy bonus",
    "use_adaptive_entropy": "an adaptive entropy bonus (it can switch on during training)",
    "router_aux_loss_coef": "a router aux loss",
    "aux_loss_coef": "an aux loss",
    "positive_example_nll_weight": "an NLL term",
}
#: settings whose neutral value is not 0, with why another value breaks the filter.
_NEUTRAL = {
    "top_entropy_quantile": (
        1.0,
        "the entropy quantile is taken over every row of the micro-batch, so dropping rows changes which tokens enter",
    ),
}


def require_filter_compatible(*, framework: str | None = None, **coefficients: float) -> None:
    """Raise :class:`IncompatibleOptionsError` unless every setting leaves the filter exact.

    Coefficients (``beta=0.04``, ``entropy_coeff=0.0``, ``router_aux_loss_coef=...``) must be
    exactly 0; ``top_entropy_quantile`` must be 1.0. ``framework`` only names the caller in
    messages about unknown coefficient names. All offending settings are reported at once.
    """
    problems = []
    fix = "or pass zero_advantage_filter=False (or 'auto') to grpo_patches.enable(...)"
    for name, value in coefficients.items():
        if isinstance(value, (bool, str, bytes)):
            raise OptionError(f"{name} must be a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise OptionError(f"{name} must be a number, got {value!r}") from None
        neutral, why = _NEUTRAL.get(name, (0.0, None))
        if number == neutral:
            continue
        if why is None:
            owner = f"the {framework} term weighted by {name}" if framework else f"the term weighted by {name}"
            why = f"{_TERMS.get(name, owner)} gives zero-advantage rows a gradient"
        shown = repr(number) if math.isfinite(number) else str(number)
        problems.append(
            f"the zero-advantage filter needs {name} == {neutral:g} (got {shown}): {why}. "
            f"Set {name}={neutral:g}, {fix}"
        )
    if problems:
        raise IncompatibleOptionsError("\n".join(problems))
