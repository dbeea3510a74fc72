"""The filtered mini-batch's micro-batches on verl's FSDP engine (0.8.0-0.9.1): as few as the kept rows fill.

verl cuts a mini-batch in ``engine.utils.prepare_micro_batches``: under ``use_dynamic_bsz`` by
token budget (``max_token_len_per_gpu``, the count agreed over data-parallel ranks), which packs
the kept rows :mod:`.zero_advantage_engine` hands it by itself; under static batching into chunks
of exactly ``micro_batch_size_per_gpu`` rows (it asserts rows % size == 0). There, with ``M``
that size and ``K`` kept rows (the same ``K`` on every rank: the hook agrees it over the group),
the filtered call carries its own size ``ceil(K / n)`` for ``n = ceil(K / M)`` micro-batches,
topped up with fewer than ``n`` weight-0 rows (zero-advantage rows, shortest first).

Exact: in verl 0.8.0-0.9.1 ``micro_batch_size_per_gpu`` is read only by ``prepare_micro_batches``
(to count the chunks). The FSDP engine backpropagates each micro-batch's loss unscaled (no
``1 / micro-batches`` factor, unlike Megatron's schedule, whose filter does not resize), and
``ppo_loss`` divides every agg mode by numbers set before the micro-batches are cut
(``batch_num_tokens``, ``global_batch_size``, ``dp_size``, ``loss_scale_factor``); the one width
that follows the micro-batch (``seq-mean-token-sum-norm`` with nested masks and no
``loss_scale_factor``) is refused by :func:`.zero_advantage_engine.settings_problems`.
"""

from __future__ import annotations

from typing import Any

from grpo_patches.row_merge import round_up


def dynamic(data: Any) -> bool:
    from verl.utils import tensordict_utils as tu

    return bool(tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True))


def static_size(data: Any) -> int:
    """verl's static micro-batch size for ``data`` (``micro_batch_size_per_gpu``)."""
    from verl.utils import tensordict_utils as tu

    return int(tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=1))


def packed_rows(keep: Any, mask: Any, data: Any) -> tuple[Any, int | None]:
    """``(rows to run, their static micro-batch size)``: under static batching ``keep`` topped up to
    ``n * ceil(K / n)`` rows, ``n = ceil(K / micro_batch_size_per_gpu)``; under dynamic batching
    ``keep`` as it is and ``None`` (verl packs by tokens)."""
    if dynamic(data):
        return keep, None
    rows, kept = int(mask.shape[0]), int(keep.numel())
    calls = max(-(-kept // static_size(data)), 1)
    size = max(-(-kept // calls), 1)
    return _topped_up(keep, mask, min(round_up(kept, size), rows)), size


def _topped_up(keep: Any, mask: Any, target: int) -> Any:
    """``keep`` and ``target - len(keep)`` more rows outside it (shortest first), in row order: every
    row outside ``keep`` has advantage 0, so each added row's loss is exactly 0."""
    import torch

    if target == keep.numel():
        return keep
    taken = torch.zeros(int(mask.shape[0]), dtype=torch.bool)
    taken[keep] = True
    free = torch.nonzero(~taken).flatten()
    lengths = mask.to(torch.float64).sum(-1).cpu()[free]
    extra = free[torch.sort(lengths, stable=True).indices][: target - int(keep.numel())]
    return torch.sort(torch.cat([keep, extra])).values


def micro_batch_count(engine: Any, data: Any) -> int:
    """How many micro-batches (forward/backward calls) verl's ``forward_backward_batch`` cuts ``data``
    into: static, rows / size; dynamic, verl's own ``prepare_micro_batches`` on the rows' lengths
    alone (its count agreed over the group: every rank calls this at the same point)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    if not dynamic(data):
        return len(data) // static_size(data)
    lengths = data.select(*[k for k in ("input_ids", "attention_mask") if k in data.keys()])
    settings = {k: tu.get_non_tensor_data(data=data, key=k, default=None) for k in ("max_token_len_per_gpu",
                                                                                     "force_group_size")}
    tu.assign_non_tensor(lengths, use_dynamic_bsz=True, sp_size=int(getattr(engine, "ulysses_sequence_parallel_size", 1)),
                         **{k: v for k, v in settings.items() if v is not None})
    micro_batches, _ = prepare_micro_batches(data=lengths, dp_group=engine.get_data_parallel_group(),
                                             same_micro_num_in_dp=True)
    return len(micro_batches)
