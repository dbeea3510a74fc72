"""Verify mode in the real ``DTensorPolicyWorkerV2`` ``train()`` (v0.6.0+), in-process (gloo, CPU).

The cases are those the stand-in runs (:mod:`tests.helpers.nemo_verify_cases`), on the real
worker of the tag on the path with a tiny Qwen2; plus FSDP2 (gradients only in the sharded
``.grad``), a skipped prev-logprob pass whose values differ because dropout is left on, and two
data-parallel ranks that must agree. v0.5.0 has no verify mode (refused at ``enable``).
"""

from __future__ import annotations

import functools
import multiprocessing
import socket

import pytest
import torch

import grpo_patches
from grpo_patches.errors import ExactnessError, UnsupportedFrameworkError
from grpo_patches_testing import nemo_rl_cpu as harness
from tests.compat_nemo_rl.dp2 import run_ranks
from tests.helpers import nemo_verify_cases as cases
from tests.helpers.nemo_worker_harness import batched, make_batch

TAG = harness.setup()
harness.need_worker()
needs_new = pytest.mark.skipif(TAG == "v0.5.0", reason="verify mode needs NeMo-RL >= 0.6.0 (refused on v0.5.0)")
FSDP = functools.partial(harness.real_worker, fsdp=True)


@pytest.fixture(autouse=True)
def _clean():
    yield
    grpo_patches.disable()


@pytest.mark.skipif(TAG != "v0.5.0", reason="v0.5.0 only")
def test_v050_refuses_verify_mode():
    with pytest.raises(UnsupportedFrameworkError, match="verify mode"):
        grpo_patches.enable("nemo_rl", verify_every=1)


@needs_new
def test_verify_passes_and_leaves_no_trace(record_property):
    cases.verify_passes_and_leaves_no_trace(TAG, harness.real_worker, record_property)


@needs_new
def test_verify_under_fsdp2_with_the_tiled_loss(record_property):
    cases.verify_passes_and_leaves_no_trace(TAG, FSDP, record_property, tiled=True, label="fsdp2_tiled_")


@needs_new
def test_bf16_is_held_to_the_measured_noise_floor(record_property):
    cases.bf16_is_held_to_the_noise_floor(TAG, harness.real_worker, record_property)


@needs_new
def test_bf16_with_the_tiled_loss_is_no_false_alarm(record_property):
    cases.bf16_tiled_is_no_false_alarm(TAG, harness.real_worker, record_property)


@needs_new
def test_bf16_with_the_tiled_loss_under_fsdp2(record_property):
    """The fp32-head reference through FSDP2's unshard hooks (the head's weight gathered as in NeMo-RL)."""
    cases.bf16_tiled_is_no_false_alarm(TAG, FSDP, record_property, label="fsdp2_")


@needs_new
def test_bf16_tiled_false_alarm_without_the_fp32_head_reference(record_property):
    """Issue 33's false alarm, reproduced: one row per micro-batch (the re-batched repeat is then
    bitwise: the floor clamps to a tenth of the epsilon) and large logits (the final norm x64),
    which NeMo-RL's bf16 logits round far. Judged against the fp32-head reference it is gone."""
    large_logits = functools.partial(harness.real_worker, norm_scale=64.0)
    ratios = cases.bf16_tiled_is_no_false_alarm(TAG, large_logits, record_property, mbs=1, label="large_logits_")
    assert ratios["before"] > 1.5 and ratios["correct"] < 0.1, ratios


@needs_new
def test_a_faulty_filter_is_caught_on_the_first_verify_step():
    cases.faulty_filter_raises(TAG, harness.real_worker)


@needs_new
def test_disable_switches_the_filter_off_and_the_run_ends_as_unpatched(record_property):
    cases.faulty_filter_disable_ends_as_unpatched(TAG, harness.real_worker, record_property)


@needs_new
def test_a_skipped_prev_pass_is_checked(record_property):
    cases.skipped_prev_is_checked(TAG, harness.real_worker, record_property)


def _dropout_worker(tag: str, gbs: int, mbs: int) -> object:
    worker = harness.real_worker(tag, gbs, mbs)
    for module in worker.model.modules():
        if isinstance(module, torch.nn.Dropout) or hasattr(module, "attention_dropout"):
            if hasattr(module, "attention_dropout"):
                module.attention_dropout = 0.3
            else:
                module.p = 0.3
    return worker


@needs_new
def test_a_skipped_pass_under_dropout_is_caught():
    """Dropout left on: NeMo-RL's prev-logprob pass (eval mode) is not what the training forward
    gives, so skipping it is not exact; the first verify step says so."""
    batch = make_batch(rows=12)
    worker = _dropout_worker(TAG, 12, 4)
    with torch.no_grad():
        real = worker.get_logprobs(batched(batch))["logprobs"]
    with pytest.raises(ExactnessError) as caught:
        cases.train(TAG, _dropout_worker, dict(batch, prev_logprobs=real), {"zero_advantage_filter": False,
                    "verify_every": 1}, gbs=12, mbs=4, loss_fn=cases._skipped_prev_loss(TAG))
    assert caught.value.optimizations == ("logprob_skip",) and caught.value.measured > 1e-3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_new
def test_two_data_parallel_ranks_agree(record_property):
    """FSDP2 over two gloo ranks: each verifies, the figures agree (one all-reduce); a faulty
    plugin on one rank only switches the filter off on both, and both end as unpatched."""
    results = run_ranks(multiprocessing.get_context("spawn"), _free_port(), verify=True)
    assert results[0]["figure"] == results[1]["figure"] <= 1e-5
    assert results[0]["faulty_figure"] == results[1]["faulty_figure"] > 1e-3
    for rank in results:
        record_property(f"exact_verify_dp2_rank{rank['rank']}_grad_rel", rank["grad_rel"])
        assert rank["grad_rel"] <= cases.TOL and rank["faulty_grad_rel"] <= cases.TOL, rank
        assert rank["faulty_switched_off"] == ["zero_advantage_filter"]


@needs_new
def test_a_skipped_reference_pass_is_checked():
    cases.skipped_reference_is_checked(TAG, harness.real_worker)
