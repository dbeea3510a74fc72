"""Zero-advantage filter under data parallelism: 2 gloo processes, different zero patterns.

Both ranks must keep the same number of rows, and the DP-averaged gradient (all_reduce / 2)
with the filter must equal the one without (fp64, max relative difference <= 1e-6), for every
framework mode of the single-process test. A rank with fewer useful rows pads with its own
zero-advantage rows at weight 0; a weight that ignored those padding rows in the local
denominator is checked to fail.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from grpo_patches.zero_advantage import filter_zero_advantage
from tests.helpers.spawned_ranks import run_ranks
from tests.helpers.zero_advantage_cases import CASES, TOL, loss_and_grads, make_batch, make_model, max_rel_diff

WORLD = 2
#: per scenario, the zero-advantage rows of rank 0 and rank 1 (6 rows each)
SCENARIOS = {
    "uneven": ([1, 4], [0, 2, 3, 5]),  # 4 vs 2 useful rows: rank 1 pads 2
    "one-rank-all-zero": ([5], [0, 1, 2, 3, 4, 5]),  # rank 1 keeps 5 zero rows at weight 0
    "both-all-zero": ([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]),  # one row each, weight 0
}


def _averaged(values: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for value in values:
        value = value.clone()
        dist.all_reduce(value)
        out.append(value / WORLD)
    return out


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model = make_model()  # identical weights on both ranks
        explicit_group = dist.new_group(list(range(WORLD)))
        results = {}
        for scenario, zero_rows in SCENARIOS.items():
            batch = make_batch(100 + rank, zero_rows[rank])  # different data and lengths per rank
            for case, (_, _, denominator, aggregate) in CASES.items():
                group = explicit_group if case.startswith("trl-bnpo") else None
                filt = filter_zero_advantage(batch["advantages"], batch["mask"], denominator, group=group)
                want = _averaged(loss_and_grads(model, batch, aggregate))
                got = _averaged(loss_and_grads(model, batch, aggregate, filt))
                wrong = None
                if denominator == "tokens" and filt.padding_rows and filt.scale:
                    # the denominator without the padding rows' tokens: must be detected
                    real = filt.keep[filt.weights != 0]
                    weights = torch.where(filt.weights != 0, batch["mask"][real].sum() / batch["mask"].sum(), 0.0)
                    wrong = max_rel_diff(_averaged(loss_and_grads(model, batch, aggregate, filt, weights)), want)
                else:
                    _averaged(loss_and_grads(model, batch, aggregate, filt))  # keep collectives paired
                results[scenario, case] = {
                    "kept": filt.rows_kept,
                    "padding": filt.padding_rows,
                    "dropped": filt.rows_dropped,
                    "rel": max_rel_diff(got, want),
                    "wrong": wrong,
                }
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    return run_ranks(_worker, (str(tmp / "store"), str(tmp)), WORLD, tmp, timeout=120, what="the 2-process gloo run")


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_ranks_keep_the_same_row_count(rank_results, scenario):
    zero0, zero1 = SCENARIOS[scenario]
    useful = [6 - len(zero0), 6 - len(zero1)]
    target = max(max(useful), 1)
    for case in CASES:
        r0, r1 = (rank_results[rank][scenario, case] for rank in range(WORLD))
        assert r0["kept"] == r1["kept"] == target, case
        for rank, result in enumerate((r0, r1)):
            assert result["padding"] == target - useful[rank]
            assert result["dropped"] == 6 - target


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_dp_averaged_gradient_is_unchanged(rank_results, scenario):
    for case in CASES:
        for rank in range(WORLD):
            assert rank_results[rank][scenario, case]["rel"] <= TOL, (rank, case)


def test_ignoring_padding_in_the_denominator_would_fail(rank_results):
    wrong = [r["wrong"] for result in rank_results for r in result.values() if r["wrong"] is not None]
    assert wrong and min(wrong) > 1e-3
