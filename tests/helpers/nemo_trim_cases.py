"""The zero-advantage filter's micro-batches cut to the columns their rows use (:mod:`grpo_patches.adapters.nemo_rl.trim`),
shared by the stand-in tests and the real-source tests (each case takes the tag and a worker factory).

The batch has rows of varied lengths whose zero-advantage rows are the longest, so the kept rows'
micro-batches are narrower than the global batch NeMo-RL pads every micro-batch to.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from tests.helpers.nemo_worker_cases import TOL, Factory, _both
from tests.helpers.nemo_worker_harness import ZERO_ROWS, make_batch, max_grad_rel, summed

SEQ = 12
METRIC = "grpo_patches/padding_tokens_skipped"


def varied_batch(rows: int = 12, seq: int = SEQ) -> dict[str, torch.Tensor]:
    """``make_batch``'s rows with lengths 5..9 for the kept rows and ``seq`` for the zero-advantage ones."""
    batch = make_batch(rows=rows, seq=seq)
    lengths = torch.tensor([seq if r in ZERO_ROWS else 5 + (r * 3) % 5 for r in range(rows)])
    pos = torch.arange(seq)[None, :]
    inside = pos < lengths[:, None]
    response = (pos >= 3) & inside
    out = {k: v.clone() for k, v in batch.items()}
    out["input_lengths"] = lengths
    out["input_ids"] = torch.where(inside, torch.randint(1, 23, (rows, seq), generator=torch.Generator().manual_seed(2)), 0)
    out["token_mask"] = response.float()
    row_adv = batch["advantages"].sum(dim=1) / batch["token_mask"].sum(dim=1).clamp(min=1)
    row_adv[list(ZERO_ROWS)] = 0.0
    out["advantages"] = row_adv[:, None] * out["token_mask"]
    for name in ("generation_logprobs", "prev_logprobs", "reference_policy_logprobs"):
        out[name] = batch[name] * out["token_mask"]
    return out


def _recording(factory: Factory, widths: list[tuple[int, int]], multiple: int, dynamic: bool) -> Factory:
    """``factory`` whose workers record each forward's (rows, width), with ``multiple`` as
    ``policy.make_sequence_length_divisible_by`` (dynamic batching: ``sequence_length_round``)."""
    def make(*args: Any, **kwargs: Any) -> Any:
        worker = factory(*args, **kwargs)
        worker.cfg["make_sequence_length_divisible_by"] = multiple
        if dynamic:
            worker.cfg["dynamic_batching"]["sequence_length_round"] = multiple

        def record(module: Any, args: tuple, kw: dict) -> None:
            ids = kw.get("input_ids", args[0] if args else None)
            widths.append((int(ids.shape[0]), int(ids.shape[1])))

        worker.model.register_forward_pre_hook(record, with_kwargs=True)
        return worker

    return make


#: Dynamic batching's micro-batches of :func:`varied_batch` (start, end, length), as NeMo-RL's driver lays them out.
DYNAMIC = [(0, 4, SEQ), (4, 8, SEQ), (8, 12, SEQ)]


def _expected(batch: dict[str, torch.Tensor], mbs: int, multiple: int,
              dynamic: list | None) -> tuple[list[int], int]:
    """The widths of the kept micro-batches (plain: kept rows in order, ``mbs`` at a time; dynamic:
    each range's kept rows) and the positions cut."""
    kept = [r for r in range(len(batch["input_lengths"])) if r not in ZERO_ROWS]
    if dynamic is None:
        groups = [(kept[i:i + mbs], SEQ) for i in range(0, len(kept), mbs)]
    else:
        groups = [([r for r in kept if s <= r < e], n) for s, e, n in dynamic]
    widths, cut = [], 0
    for rows, full in groups:
        if rows:
            used = int(batch["input_lengths"][rows].max())
            width = min(-(-used // multiple) * multiple, full)
            widths.append(width)
            cut += len(rows) * (full - width)
    return widths, cut


def kept_microbatches_are_trimmed(tag: str, factory: Factory, record_property: Callable, multiple: int = 1,
                                  options: dict | None = None, dynamic: bool = False) -> None:
    """Same gradients and metrics as NeMo-RL unpatched and as the filter without the cut; every
    kept micro-batch as wide as its longest row (rounded up to ``multiple``); the saving counted."""
    from grpo_patches.adapters.nemo_rl import trim

    batch, gbs, mbs = varied_batch(), 12, 2
    layout = DYNAMIC if dynamic else None
    options = {"zero_advantage_filter": True, **(options or {})}
    widths: list[tuple[int, int]] = []
    kw = {"micro_batches": layout, "worker_kw": {"dynamic": dynamic}}
    base, patched = _both(tag, _recording(factory, widths, multiple, dynamic), batch, options, gbs=gbs, mbs=mbs, **kw)
    diff = max_grad_rel(patched, base)
    record_property(f"exact_filter_trimmed_{'dynamic_' if dynamic else ''}x{multiple}_grad_rel", diff)
    assert diff <= TOL, diff
    want_widths, want_cut = _expected(batch, mbs, multiple, layout)
    upstream = len(layout) if dynamic else gbs // mbs
    assert [w for _, w in widths[:upstream]] == [SEQ] * upstream  # NeMo-RL: every micro-batch at the batch's width
    kept = [w for _, w in widths[upstream:]][:len(want_widths)]  # then metrics-only ones (full-width dropped rows)
    assert kept == want_widths and want_cut > 0
    assert patched.totals["padding_tokens_skipped"] == want_cut
    assert sum(patched.metrics[METRIC]) == want_cut

    untrimmed = pytest.MonkeyPatch()
    untrimmed.setattr(trim, "used_width", lambda mb: int(mb["input_ids"].shape[1]))
    try:
        _, whole = _both(tag, factory, batch, options, gbs=gbs, mbs=mbs, **kw)
    finally:
        untrimmed.undo()
    assert whole.totals.get("padding_tokens_skipped", 0) == 0
    assert max_grad_rel(patched, whole) <= TOL
    before, after, full = summed(base.metrics), summed(patched.metrics), summed(whole.metrics)
    for key in ("loss", "num_valid_samples"):
        assert after[key] == pytest.approx(before[key], rel=TOL, abs=1e-9), key
    for key, value in full.items():  # every metric, the kept-rows ones included
        if key != METRIC:
            assert after[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def one_column_too_many_is_caught(tag: str, factory: Factory) -> None:
    """A planted fault — each kept micro-batch cut one column short of its longest row — changes
    the gradient beyond the tolerance: the exactness check above can fail."""
    from grpo_patches.adapters.nemo_rl import trim

    batch = varied_batch()
    real = trim.used_width
    fault = pytest.MonkeyPatch()
    fault.setattr(trim, "used_width", lambda mb: real(mb) - 1)
    try:
        base, patched = _both(tag, factory, batch, {"zero_advantage_filter": True}, gbs=12, mbs=2)
    finally:
        fault.undo()
    assert max_grad_rel(patched, base) > 100 * TOL
