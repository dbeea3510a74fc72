"""The NeMo-RL adapter's driver wrappers on the real objects of the tag on the path.

The real ``grpo_train`` needs generation workers (vLLM) and is not run here (the stand-in's
``grpo_train`` proves the loop: ``tests/test_nemo_rl_driver.py``). These tests call the real
functions and methods the loop calls, wrapped, where a call that reached the Ray workers would
fail: the real ``Policy`` object has no worker group here.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import grpo_patches
from grpo_patches.adapters.nemo_rl.state import LOOP, LoopCall, policy_state
from grpo_patches_testing import nemo_rl_cpu as harness
from tests.helpers.nemo_fake import master_config
from tests.helpers.nemo_worker_harness import batched, make_batch, make_loss

TAG = harness.setup()
OLD = TAG in ("v0.5.0", "v0.6.0")


@pytest.fixture(autouse=True)
def _clean():
    grpo_patches.enable("nemo_rl", zero_advantage_filter=False)
    yield
    grpo_patches.disable()


def _policy():
    """A real ``Policy`` without workers (its ``__init__`` needs a Ray cluster)."""
    from nemo_rl.models.policy.lm_policy import Policy

    policy = object.__new__(Policy)
    policy.cfg = {"train_global_batch_size": 8, "train_micro_batch_size": 2}
    return policy


def _loop(tag: str, **loss) -> LoopCall:
    return LoopCall(policy=_policy(), loss_fn=make_loss(tag, **loss), config=master_config(tag, loss=loss))


@pytest.mark.skipif(OLD, reason="v0.5.0 / v0.6.0 skip through Policy.get_logprobs")
def test_the_real_predicate_says_skip_when_on_policy():
    opd = importlib.import_module("nemo_rl.algorithms.opd")
    loop = _loop(TAG)
    assert opd._skip_prev_logprobs(loop.config) is False  # outside grpo_train: NeMo-RL's own answer
    with LOOP.entered(loop):
        assert opd._skip_prev_logprobs(loop.config) is True
        assert loop.prev == "skipped" and loop.placeholders
        needed = _loop(TAG, use_importance_sampling_correction=True)
        with LOOP.entered(needed):
            assert opd._skip_prev_logprobs(needed.config) is False and needed.prev == "run"


@pytest.mark.skipif(not OLD, reason="v0.7.0+ skip through opd._skip_prev_logprobs")
def test_the_real_get_logprobs_answers_zeros_without_the_workers():
    loop = _loop(TAG)
    data = batched({k: v for k, v in make_batch(rows=8).items() if k in ("input_ids", "token_mask", "sample_mask")})
    with LOOP.entered(loop):
        logprobs = loop.policy.get_logprobs(data)["logprobs"]
    assert torch.equal(logprobs, torch.zeros(8, 9)) and loop.prev == "skipped"
    with pytest.raises(AttributeError):  # outside grpo_train it is NeMo-RL's, and needs its workers
        loop.policy.get_logprobs(data)


@pytest.mark.skipif(TAG != "v0.6.0", reason="v0.6.0 computes sequence-level errors from prev unconditionally")
def test_the_real_sequence_error_metrics_are_placeholders_on_a_skipped_pass():
    grpo = importlib.import_module("nemo_rl.algorithms.grpo")
    loop = _loop(TAG)
    loop.prev = "skipped"
    with LOOP.entered(loop):
        assert grpo.compute_and_apply_seq_logprob_error_masking(batched(make_batch()), torch.ones(12), None) == (
            0.0, 0, 0.0)
    assert loop.placeholders


@pytest.mark.skipif(not OLD, reason="NeMo-RL >= 0.7.0 builds no reference model at KL 0 itself")
def test_the_real_reference_logprobs_are_zeros_without_a_reference_model():
    policy = _policy()
    policy_state(policy).reference_skipped = True
    out = policy.get_reference_policy_logprobs(batched(make_batch(rows=4)))
    assert torch.equal(out["reference_logprobs"], torch.zeros(4, 9))
    assert grpo_patches.status()["nemo_rl"]["savings"]["reference_passes_skipped"] == 1
