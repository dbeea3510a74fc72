"""open-instruct's OLMo-core learner, unpatched: the real ``GRPOTrainModule.train_batch`` on a CPU.

Runs only with the test-only intra-document attention for OLMo-core's torch backend
(:func:`grpo_patches_testing.open_instruct_olmo_core.doc_masked_attention`), checked here against
documents run one by one; then the work ``train_batch`` does is counted against its code.
"""

from __future__ import annotations

import math

import pytest

from grpo_patches_testing import open_instruct_cpu as deepspeed_learner
from grpo_patches_testing import open_instruct_olmo_core as harness

harness.load()  # skips without open-instruct (and its ai2-olmo-core) on the path

BASE = deepspeed_learner.Config(steps=1, prompts=4, samples_per_prompt=4, zero_std_groups=1, pack_length=32,
                                learning_rate=1e-3)
CONFIGS = [
    BASE,  # nmb 1, beta 0, load_ref_policy (default): no reference model on this learner
    deepspeed_learner.replace(BASE, num_mini_batches=2, num_epochs=2, beta=0.05),
]


def expected(config: deepspeed_learner.Config, shapes: list[list[tuple[int, ...]]]) -> dict[str, int]:
    """What ``GRPOTrainModule.train_batch`` (olmo_core_train_modules.py, :391 v0.3.0 / :430 main) does:
    ``accumulation_steps = max(ceil(n / num_mini_batches), 1)``, nothing dropped; the reference pass
    only when a reference model exists (``load_ref_policy and beta > 0``, grpo_olmo_core_actor.py:133)
    and the pre-pass when ``num_mini_batches > 1``, each through ``compute_logprobs`` with
    ``batch_size=3 * rank_microbatch_size`` (one forward when every micro-batch has one shape, else one
    per micro-batch); an optimizer step every ``accumulation_steps`` micro-batches counted across
    epochs, plus one for a partial group after the last epoch."""
    out = {"ref_forwards": 0, "old_logprob_forwards": 0, "policy_forwards": 0, "optimizer_steps": 0}
    for step in shapes:
        n = len(step)
        passes = 1 if len(set(step)) == 1 and n <= 3 * config.per_device_train_batch_size * config.pack_length else n
        accumulation = max(math.ceil(n / config.num_mini_batches), 1)
        out["ref_forwards"] += passes if config.load_ref_policy and config.beta > 0 else 0
        out["old_logprob_forwards"] += passes if config.num_mini_batches > 1 else 0
        out["policy_forwards"] += config.num_epochs * n
        out["optimizer_steps"] += math.ceil(config.num_epochs * n / accumulation)
    return out


@pytest.fixture(scope="module")
def results() -> list[deepspeed_learner.Result]:
    return [harness.train(config) for config in CONFIGS]


def test_doc_masked_attention_matches_documents_one_by_one():
    import torch
    from open_instruct.olmo_core_utils import doc_lens_from_attention_mask

    model = harness.tiny_transformer(203).eval()
    first, second = [5, 9, 14, 20, 7], [33, 8, 41]
    packed = torch.tensor([first + second + [0, 0]])
    mask = torch.tensor([[1] * len(first) + [2] * len(second) + [0, 0]])
    doc_lens, max_doc_lens = doc_lens_from_attention_mask(mask)
    with torch.no_grad(), harness.doc_masked_attention():
        together = model(packed, doc_lens=doc_lens, max_doc_lens=max_doc_lens)
        alone = [model(torch.tensor([ids])) for ids in (first, second)]
        unmasked = model(packed)
    torch.testing.assert_close(together[0, :len(first)], alone[0][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(together[0, len(first):len(first) + len(second)], alone[1][0], rtol=0, atol=1e-5)
    assert (unmasked[0, len(first):len(first) + 3] - alone[1][0]).abs().max() > 1e-3  # the mask matters


@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_counts_follow_train_batch(results, index, record_property):
    config, result = CONFIGS[index], results[index]
    counts = {"ref_forwards": result.ref_forwards, "old_logprob_forwards": result.old_logprob_forwards,
              "policy_forwards": result.policy_forwards, "optimizer_steps": len(result.gradients)}
    assert counts == expected(config, result.micro_batch_shapes)
    assert result.full_logits == result.ref_forwards + result.old_logprob_forwards + result.policy_forwards
    assert all(g > 0 for g in result.grad_norms)
    for key, value in counts.items():
        record_property(f"olmo_core_baseline_{index}_{key}", value)


def test_beta_zero_builds_no_reference_and_logs_zero_kl(results):
    """At beta 0 this learner builds no reference model, and logs ``objective/kl*_avg`` as 0.0
    (zero-filled by ``create_loss_stats``), as the DeepSpeed learner does with ``load_ref_policy=False``."""
    at_zero = results[0]
    assert not at_zero.ref_model_built and at_zero.ref_forwards == 0
    assert at_zero.metrics[0]["objective/kl0_avg"] == 0.0
