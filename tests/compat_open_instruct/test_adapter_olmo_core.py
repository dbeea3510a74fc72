"""The open-instruct adapter on the real OLMo-core learner: ``GRPOTrainModule.train_batch``, patched
against unpatched, one rank (the harness's test-only intra-document attention), fp32, OLMo-core's AdamW:
every optimizer step's gradient is recorded and compared.

Two mini-batches, two epochs, two zero-advantage groups in 16 responses (6 micro-batches of one row, the
4th and 6th of advantage 0),
temperature 0.7: the old-logprob pre-pass window, the zero-advantage filter and the tiled lm-head
(with verify mode on every step) apply; this learner has no reference model at beta 0 of its own. Each
has a planted fault: a filter dropping a useful micro-batch (1.0), stale old log-probs after the first
optimizer step (0.66), the tiled lm-head at temperature 1 (1.99).
"""

from __future__ import annotations

import pytest

from grpo_patches_testing import open_instruct_cpu as deepspeed_learner
from grpo_patches_testing import open_instruct_olmo_core as harness
from tests.helpers.open_instruct_compare import (ALL_ON, ALL_ON_TILED, cached_runs, cold_tiled, counts, distance,
                                                dropping_a_useful_micro_batch, planted_fault_gap, stale_old_logprobs)

harness.load()  # skips without open-instruct (and its ai2-olmo-core) on the path

BASE = deepspeed_learner.Config(steps=1, prompts=4, samples_per_prompt=4, zero_std_groups=(0, 3), pack_length=32,
                                num_mini_batches=2, num_epochs=2, temperature=0.7, learning_rate=1e-3)
RUNS = {
    "base": BASE,
    "exact": deepspeed_learner.replace(BASE, enable=ALL_ON),
    "tiled": deepspeed_learner.replace(BASE, enable=dict(ALL_ON_TILED, verify_every=1)),
}


@pytest.fixture(scope="module")
def run():
    return cached_runs(harness.train, RUNS)


def test_the_window_and_the_filter_change_no_gradient(run, record_property):
    base, patched = run("base"), run("exact")
    gap = distance(patched, base)
    record_property("exact_olmo_core_all", gap)
    assert gap <= 1e-6
    before, after = counts(base), counts(patched)
    record_property("saved_olmo_core", f"{before} -> {after}")
    assert after["optimizer_steps"] == before["optimizer_steps"] == 4
    assert after["policy_forwards"] == before["policy_forwards"] - 4
    assert after["old_logprob_forwards"] < before["old_logprob_forwards"]
    metrics = patched.metrics[0]
    assert metrics["grpo_patches/old_logprob_micro_batches_skipped"] == 5.0
    assert not any(name.startswith("objective/kl") for name in metrics)  # upstream logs zeros: no reference
    assert "debug/vllm_vs_local_logprob_diff_mean/kept_rows" in metrics


def test_the_tiled_lm_head_on_olmo_core(run, record_property):
    base, patched = run("base"), run("tiled")
    gap = distance(patched, base)
    record_property("exact_olmo_core_tiled", gap)
    assert gap <= 1e-5
    assert base.full_logits > 0 and patched.full_logits == 0
    assert patched.metrics[0]["grpo_patches/verify/dropped_grad_max_abs"] == 0.0
    assert patched.metrics[0]["grpo_patches/verify/tiled_grad_rel_diff"] <= 1e-5


def test_a_filter_that_drops_a_useful_micro_batch_is_caught(run, monkeypatch, record_property):
    from grpo_patches.adapters.open_instruct import zero_advantage

    monkeypatch.setattr(zero_advantage, "plan", dropping_a_useful_micro_batch(zero_advantage.plan))
    gap = distance(harness.train(RUNS["exact"]), run("base"))
    record_property("fault_olmo_core_filter", gap)
    assert gap > 1e-3


def test_stale_old_logprobs_after_the_first_optimizer_step_are_caught(run, record_property):
    """The window's planted fault: no pre-pass, every micro-batch's old log-probs the current ones."""
    gap = planted_fault_gap(stale_old_logprobs(), lambda: harness.train(RUNS["exact"]), run("base"),
                            record_property, "fault_olmo_core_stale_old_logprobs")
    assert gap > 1e-3


def test_a_tiled_lm_head_at_the_wrong_temperature_is_caught(run, record_property):
    gap = planted_fault_gap(cold_tiled(), lambda: harness.train(deepspeed_learner.replace(BASE, enable=ALL_ON_TILED)),
                            run("base"), record_property, "fault_olmo_core_tiled")
    assert gap > 1e-3
