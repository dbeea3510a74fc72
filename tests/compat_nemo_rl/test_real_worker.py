"""The NeMo-RL adapter in the real ``DTensorPolicyWorkerV2`` ``train()``, in-process (gloo, CPU).

The cases are those the stand-in runs (:mod:`tests.helpers.nemo_worker_cases`), here on the real
worker of the tag on the path with a tiny Qwen2; plus FSDP2 (the model's real forward with its
unshard hooks) and two data-parallel ranks that keep different numbers of rows.
"""

from __future__ import annotations

import functools
import multiprocessing
import socket

import pytest

import grpo_patches
from tests.helpers import nemo_trim_cases as trim_cases
from tests.helpers import nemo_worker_cases as cases
from grpo_patches_testing import nemo_rl_cpu as harness
from tests.compat_nemo_rl.dp2 import run_ranks

TAG = harness.setup()
harness.need_worker()
NEW = TAG != "v0.5.0"
needs_new = pytest.mark.skipif(not NEW, reason="the tiled loss and dropped_rows_metrics=True need NeMo-RL >= 0.6.0")
FSDP = functools.partial(harness.real_worker, fsdp=True)


@pytest.fixture(autouse=True)
def _clean():
    yield
    grpo_patches.disable()


@pytest.mark.parametrize("case", sorted(cases.FILTER_CASES))
def test_filter_matches_upstream(case, record_property):
    cases.filter_matches_upstream(TAG, harness.real_worker, case, record_property)


def test_filter_under_fsdp2(record_property):
    cases.filter_matches_upstream(TAG, FSDP, "two-optimizer-steps", record_property, label="fsdp2_")


def test_kept_rows_metrics_are_kept_row_means():
    cases.kept_rows_metrics_are_kept_row_means(TAG, harness.real_worker)


@needs_new
def test_dropped_rows_metrics_are_upstream_metrics(record_property):
    cases.dropped_rows_metrics_are_upstream_metrics(TAG, harness.real_worker, record_property)


def test_filter_refuses_or_steps_aside():
    cases.filter_refuses_or_steps_aside(TAG, harness.real_worker)


@pytest.mark.skipif(TAG in ("v0.5.0", "v0.6.0"), reason="positive_example_nll_weight is new in v0.7.0")
def test_filter_steps_aside_for_the_nll_term():
    cases.filter_steps_aside_for_the_nll_term(TAG, harness.real_worker)


def test_eval_mode_and_logprobs_see_every_row():
    cases.eval_mode_and_logprobs_see_every_row(TAG, harness.real_worker)


def test_on_policy_prev_equals_a_real_pass(record_property):
    cases.on_policy_prev_equals_a_real_pass(TAG, harness.real_worker, record_property)


@needs_new
@pytest.mark.parametrize("case", sorted(cases.TILED_CASES))
def test_tiled_matches_upstream(case, record_property):
    cases.tiled_matches_upstream(TAG, harness.real_worker, case, record_property)


@needs_new
def test_tiled_under_fsdp2_with_the_filter(record_property):
    cases.tiled_matches_upstream(TAG, functools.partial(harness.real_worker, fsdp=True, tied=True), "token-level",
                                 record_property, with_filter=True)


@needs_new
def test_tiled_refuses_or_steps_aside():
    cases.tiled_refuses_or_steps_aside(TAG, harness.real_worker)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_data_parallel_ranks_stay_aligned(record_property):
    """FSDP2 over two gloo ranks whose shards hold different numbers of zero-advantage rows: both
    run the same number of micro-batches (the rank with fewer useful rows keeps a few of its
    zero-advantage rows at zero weight), and the gradients are NeMo-RL's."""
    results = run_ranks(multiprocessing.get_context("spawn"), _free_port())
    assert sorted(r["zero_rows_here"] for r in results) == [3, 5]
    for rank in results:
        record_property(f"exact_filter_dp2_rank{rank['rank']}_grad_rel", rank["grad_rel"])
        assert rank["grad_rel"] <= cases.TOL, rank
    assert results[0]["forwards_patched"] == results[1]["forwards_patched"] < results[0]["forwards_base"]
    assert sum(r["rows_dropped"] for r in results) > 0


@pytest.mark.parametrize("dynamic", [False, True], ids=["plain", "dynamic"])
@pytest.mark.parametrize("multiple", [1, 4])
def test_kept_microbatches_are_trimmed(multiple, dynamic, record_property):
    trim_cases.kept_microbatches_are_trimmed(TAG, harness.real_worker, record_property, multiple, dynamic=dynamic)


@needs_new
def test_trimmed_with_dropped_rows_metrics(record_property):
    trim_cases.kept_microbatches_are_trimmed(TAG, harness.real_worker, record_property,
                                             options={"dropped_rows_metrics": True})


def test_one_column_too_many_is_caught():
    trim_cases.one_column_too_many_is_caught(TAG, harness.real_worker)
