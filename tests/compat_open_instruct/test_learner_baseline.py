"""open-instruct's real DeepSpeed learner, unpatched: the work its ``step()`` does, counted.

The baseline the adapter (issue 30) will be measured against: the harness
(:mod:`grpo_patches_testing.open_instruct_cpu`) runs the real ``PolicyTrainerRayProcess.step()``
on a tiny Qwen2 (fp32, SGD, gloo) and counts forwards; :func:`expected` says what
``grpo_fast.py``'s code makes of the same batch, so a count that moves means open-instruct moved.
"""

from __future__ import annotations

import math

import pytest

from grpo_patches_testing import open_instruct_cpu as harness

harness.load()  # skips without open-instruct / deepspeed on the path

BASE = harness.Config(steps=1, prompts=4, samples_per_prompt=4, zero_std_groups=1, pack_length=32)


def expected(config: harness.Config, micro_batches: list[int]) -> dict[str, int]:
    """What ``PolicyTrainerRayProcess.step()`` (grpo_fast.py, v0.3.0 = main) does per rank, summed
    over the steps: ``accumulation_steps = max(ceil(n / num_mini_batches - 0.5), 1)``, leftover
    micro-batches dropped; the reference pass over every kept micro-batch whenever
    ``load_ref_policy`` (beta is not read); the old-logprob pre-pass over every kept micro-batch
    when more than one mini-batch remains; one training forward per micro-batch and epoch; one
    optimizer step per accumulation group and epoch."""
    out = {"ref_forwards": 0, "old_logprob_forwards": 0, "policy_forwards": 0, "optimizer_steps": 0}
    for n in micro_batches:
        accumulation = max(math.ceil(n / config.num_mini_batches - 0.5), 1)
        kept = n - n % accumulation
        mini_batches = kept // accumulation
        out["ref_forwards"] += kept if config.load_ref_policy else 0
        out["old_logprob_forwards"] += kept if mini_batches > 1 else 0
        out["policy_forwards"] += config.num_epochs * kept
        out["optimizer_steps"] += config.num_epochs * mini_batches
    return out


def counts(result: harness.Result) -> dict[str, int]:
    return {"ref_forwards": result.ref_forwards, "old_logprob_forwards": result.old_logprob_forwards,
            "policy_forwards": result.policy_forwards, "optimizer_steps": len(result.grad_norms)}


ONE_RANK = [
    BASE,  # ZeRO-2, one mini-batch, beta 0 with the reference model (open-instruct's default load_ref_policy)
    harness.replace(BASE, load_ref_policy=False),
    harness.replace(BASE, num_mini_batches=2, num_epochs=2, beta=0.05),
    harness.replace(BASE, deepspeed_stage=3, num_mini_batches=2),
]


@pytest.fixture(scope="module")
def one_rank() -> list[harness.Result]:
    return [harness.train(config) for config in ONE_RANK]


@pytest.fixture(scope="module")
def two_ranks() -> list[list[harness.Result]]:
    config = harness.replace(BASE, deepspeed_stage=3, world_size=2, num_mini_batches=2, num_epochs=2, beta=0.05,
                             prompts=6)
    return harness.train_ranks([config])


@pytest.mark.parametrize("index", range(len(ONE_RANK)))
def test_counts_follow_open_instructs_step(one_rank, index, record_property):
    config, result = ONE_RANK[index], one_rank[index]
    assert counts(result) == expected(config, result.micro_batches)
    assert result.policy_rows == result.policy_forwards * config.per_device_train_batch_size
    for key, value in counts(result).items():
        record_property(f"baseline_{index}_{key}", value)


def test_the_reference_pass_runs_at_beta_zero(one_rank):
    """``load_ref_policy`` (default True) builds the reference engine and runs it on every micro-batch
    whatever beta is; at beta 0 its only products are the ``objective/kl*_avg`` metrics."""
    at_zero, without = one_rank[0], one_rank[1]
    assert BASE.beta == 0.0 and at_zero.ref_model_built and at_zero.ref_forwards == sum(at_zero.micro_batches)
    assert at_zero.metrics[0]["loss/kl_avg"] == 0.0
    assert "objective/kl0_avg" in at_zero.metrics[0]
    assert not without.ref_model_built and without.ref_forwards == 0
    assert without.metrics[0]["objective/kl0_avg"] == 0.0  # zero-filled: no reference log-probs
    # the reference pass changes nothing of the update at beta 0
    assert without.grad_norms == at_zero.grad_norms
    for name, weight in at_zero.weights.items():
        assert (without.weights[name] - weight).abs().max().item() == 0.0, name


def test_every_forward_makes_full_vocabulary_logits(one_rank):
    """``forward_for_logprobs`` takes ``output.logits``: [B, T, vocab] for every forward (training,
    pre-pass and reference)."""
    for result in one_rank:
        forwards = result.ref_forwards + result.old_logprob_forwards + result.policy_forwards
        assert result.full_logits == forwards
        assert result.largest_logits[-1] == result.weights["model.embed_tokens.weight"].shape[0]


def test_the_pre_pass_repeats_the_first_groups_log_probs(one_rank, record_property):
    """With more than one mini-batch, the pre-pass's old log-probs of epoch 0's first accumulation
    group (consumed before any optimizer step) are bitwise the training forward's own: what the
    old-logprob window (issue 30) relies on, on ZeRO-2 and ZeRO-3."""
    for index, (config, result) in enumerate(zip(ONE_RANK, one_rank)):
        if config.num_mini_batches > 1:
            assert result.first_group_old_vs_new == 0.0, (index, result.first_group_old_vs_new)
            record_property(f"baseline_{index}_first_group_old_vs_new", result.first_group_old_vs_new)
        else:
            assert result.first_group_old_vs_new is None  # no pre-pass


def test_two_ranks_agree(two_ranks):
    """ZeRO-3 on two gloo ranks: the same counts and the same gathered weights on both; each rank
    holds half of the (tied) lm-head weight outside its forward."""
    (first,), (second,) = two_ranks
    config = harness.replace(BASE, deepspeed_stage=3, world_size=2, num_mini_batches=2, num_epochs=2, beta=0.05)
    for result in (first, second):
        assert counts(result) == expected(config, result.micro_batches)
    assert first.micro_batches == second.micro_batches  # prepare_collated_data_for_workers: equal shares
    assert first.grad_norms == pytest.approx(second.grad_norms, rel=1e-6)
    for name, weight in first.weights.items():
        assert (second.weights[name] - weight).abs().max().item() == 0.0, name
    full, held = first.lm_head_elements
    assert full == first.weights["model.embed_tokens.weight"].numel() and held == full // 2
    assert first.first_group_old_vs_new == second.first_group_old_vs_new == 0.0
