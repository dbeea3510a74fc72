"""The zero-advantage filter, shared by every tag's worker: its decision and its micro-batches.

Each line's worker applies them: :mod:`.zero_advantage_v050` (v0.5.0), :mod:`.zero_advantage_v060`
(v0.6.0+), :mod:`.zero_advantage_megatron` (the Megatron policy worker, v0.6.0+). :func:`decide` says
whether the filter runs for one train call; :func:`plan` lays out its micro-batches. The rows of
one local global batch are chosen by the ``grpo_filter_zero_advantage`` hook
(denominator ``"fixed"``: NeMo-RL divides by ``global_valid_toks`` / ``global_valid_seqs``,
all-reduced over the whole global batch before micro-batching, so the kept rows keep the
original denominators and need no weights). Then:

* plain batching: the kept rows in chunks of ``train_micro_batch_size`` (the last one may be
  short); dynamic batching: the driver's micro-batch ranges, each without its dropped rows
  (an empty range disappears), truncated to the range's length as NeMo-RL does; either way
  each then cut to the columns its own rows use (:mod:`.trim`);
* every DP rank runs the same number of micro-batches (FSDP's collectives): ranks with fewer
  append zero-weight micro-batches (one row, ``sample_mask`` 0: loss and gradient exactly 0,
  and NeMo-RL skips the metrics of a micro-batch with no valid sample). The hook keeps at
  least one row, so every rank makes at least one backward (an all-zero-advantage batch still
  gives zero gradients, not ``None``, and the optimizer step matches NeMo-RL's);
* with ``dropped_rows_metrics=True`` the dropped rows follow as metrics-only micro-batches
  (their forward runs without autograd, :mod:`.dropped_rows`), aligned over DP the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grpo_patches.errors import OptionError

from . import FRAMEWORK
from .calls import loss_tensors
from .loss_modes import denominator, gradient_terms, is_mixture_of_experts
from .state import GlobalBatchFilter
from .trim import trim


def decide(loss_fn: Any, worker: Any, data: Any, packing: bool, owner: Any = None) -> bool:
    """Whether the filter runs for this train call.

    :raises IncompatibleOptionsError: ``zero_advantage_filter=True`` with a loss that gives
        zero-advantage rows a gradient, or that the filter does not cover (each setting named,
        with the fix; ``refuse_or_note``).
    """
    from grpo_patches.zero_advantage import filter_problems

    if "advantages" not in data or "token_mask" not in data:
        return False  # not a policy-gradient loss (SFT, DPO, reward model)
    moe = is_mixture_of_experts(getattr(worker, "model", None)) or hasattr(getattr(worker, "model", None),
                                                                           "update_moe_gate_bias")
    try:
        problems = filter_problems(gradient_terms(loss_fn, moe=moe))
    except OptionError as exc:  # a setting that is not a number
        problems = [str(exc)]
    try:
        denominator(loss_fn)
    except OptionError as exc:  # a loss mode this adapter does not know
        problems.append(str(exc))
    if packing:
        problems.append("sequence packing is not supported by the zero-advantage filter yet; "
                        "set policy.sequence_packing.enabled=false")
    if problems:
        return FRAMEWORK.refuse_or_note("zero_advantage_filter", problems, owner=owner)
    FRAMEWORK.note("zero_advantage_filter", "on", owner=owner)
    return True


def dp_reduce(values: list[float], group: Any, device: Any, op: str) -> list[float]:
    """``values`` reduced (``"sum"`` / ``"max"``) over the DP group (themselves outside one)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return [float(v) for v in tensor.tolist()]


def zero_weight(data: Any, row: int, length: int | None = None, multiple: int | None = 1) -> Any:
    """One row of ``data`` whose loss is exactly 0 (``sample_mask`` 0): a DP-alignment micro-batch,
    cut to its row's columns (``multiple=None``: not cut)."""
    import torch

    mb = data.select_indices([row])
    mb["sample_mask"] = torch.zeros_like(mb["sample_mask"])
    if length is not None:
        mb.truncate_tensors(dim=1, truncated_len=length)
    if multiple is not None:
        trim(mb, multiple)
    return mb


@dataclass
class Layout:
    """The micro-batches of one global batch: trained (kept rows, then DP pads), then metrics-only."""

    microbatches: list[Any] = field(default_factory=list)
    metrics_only: list[Any] = field(default_factory=list)


def _trim(microbatch: Any, multiple: int | None) -> int:
    return 0 if multiple is None else trim(microbatch, multiple)


def _chunks(data: Any, rows: list[int], mbs: int, ranges: list[tuple[int, int, int]] | None,
            multiple: int | None) -> tuple[list[Any], int]:
    """The micro-batches of ``rows``, and the padding token positions cut from them."""
    if ranges is None:
        out, cut = [], 0
        for i in range(0, len(rows), mbs):
            mb = data.select_indices(rows[i:i + mbs])
            cut += _trim(mb, multiple) * len(rows[i:i + mbs])
            out.append(mb)
        return out, cut
    chosen = set(rows)
    out, cut = [], 0
    for start, end, length in ranges:
        inside = [r for r in range(start, end) if r in chosen]
        if inside:
            mb = data.select_indices(inside)
            mb.truncate_tensors(dim=1, truncated_len=length)
            cut += _trim(mb, multiple) * len(inside)
            out.append(mb)
    return out, cut


def plan(data: Any, loss_fn: Any, mbs: int, dynamic: bool, group: Any, metrics_for_dropped: bool,
         keep_dropped: bool = False, multiple: int | None = 1) -> tuple[Layout, GlobalBatchFilter]:
    """The micro-batches of one local global batch with the zero-advantage rows left out.

    :param metrics_for_dropped: ``dropped_rows_metrics=True``: the dropped rows follow as
        metrics-only micro-batches.
    :param keep_dropped: keep the dropped rows' data in the plan (their metrics that need no
        forward, :mod:`.metrics`).
    :param multiple: a trimmed micro-batch's width stays a multiple of it (:func:`.trim.multiple_of`);
        ``None``: no micro-batch is trimmed (every one keeps the global batch's width).
    """
    from grpo_patches.plugins import hook

    advantages, mask = loss_tensors(data)
    choice = hook().grpo_filter_zero_advantage(advantages=advantages, mask=mask, denominator=denominator(loss_fn),
                                               group=group)
    rows = int(data["input_ids"].shape[0])
    keep = list(range(rows)) if choice is None else [int(i) for i in choice.keep.tolist()]
    dropped = sorted(set(range(rows)) - set(keep))
    ranges = None
    if dynamic:
        ranges = [(int(s), int(e), int(n)) for n, (s, e) in zip(data.micro_batch_lengths[0], data.micro_batch_indices[0])]
    device = data["input_ids"].device
    kept_mbs, kept_cut = _chunks(data, keep, mbs, ranges, multiple)
    drop_mbs, drop_cut = _chunks(data, dropped, mbs, ranges, multiple) if metrics_for_dropped else ([], 0)
    counts = mask.sum(dim=1).tolist()
    kept_seqs = float(data["sample_mask"][keep].sum()) if keep else 0.0
    n_kept, n_drop = (int(v) for v in dp_reduce([len(kept_mbs), len(drop_mbs)], group, device, "max"))
    seqs, toks = dp_reduce([kept_seqs, float(sum(counts[i] for i in keep))], group, device, "sum")
    shortest = min(range(rows), key=lambda r: (counts[r], r))
    length = min(n for _, _, n in ranges) if ranges else None  # dynamic batching: a short pad
    layout = Layout()
    layout.microbatches = kept_mbs + [zero_weight(data, shortest, length, multiple) for _ in range(n_kept - len(kept_mbs))]
    pads = [zero_weight(data, shortest, length, multiple) for _ in range(n_drop - len(drop_mbs))]
    layout.metrics_only = drop_mbs + pads
    upstream = len(ranges) if ranges is not None else rows // mbs
    own = GlobalBatchFilter(
        rows_dropped=len(dropped),
        tokens_dropped=int(sum(counts[i] for i in dropped)),
        micro_batches_dropped=upstream - len(layout.microbatches),
        padding_tokens_skipped=kept_cut + drop_cut,
        kept_seqs=seqs,
        kept_toks=toks,
        dropped_seqs=float(data["sample_mask"][dropped].sum()) if dropped else 0.0,
        dropped=data.select_indices(dropped) if keep_dropped and dropped else None,
    )
    own.metrics_only = list(layout.metrics_only)
    return layout, own
