"""NeMo-RL's real Megatron policy worker, unpatched, on a CPU (the harness test_real_megatron_filter.py uses).

``MegatronPolicyWorkerImpl.train`` and ``get_logprobs`` of the NeMo-RL source on the path run on a
tiny megatron-core ``GPTModel`` (:mod:`tests.helpers.nemo_rl_megatron_harness`) and are checked
against one plain forward of the same weights: the log-probs, and the gradient of NeMo-RL's own
``ClippedPGLossFn`` over the whole global batch (the worker splits it into micro-batches, and
Megatron's schedule averages what ``LossPostProcessor`` multiplied back). Skips without a NeMo-RL
source (v0.7.0+) or Megatron-Bridge on the path. The gpu tier runs the same in bf16 and compares with the
noise floor: twice what re-batching the same rows moves (the worker's micro-batches of 6 rows instead of 4).
"""

from __future__ import annotations

import pytest
import torch

from grpo_patches_testing.nemo_rl_cpu import tag
from grpo_patches_testing.nemo_rl_tags import make_loss
from tests.helpers import nemo_rl_megatron_harness as harness
from tests.helpers.megatron_tier import BF16, tolerance
from tests.helpers.nemo_worker_harness import batched, make_batch, rel

harness.setup()  # skips the module without a NeMo-RL source or Megatron-Bridge
TAG = tag()


def _recorded_train(worker, batch: dict):
    """``train()`` once; the DDP gradient of every optimizer step, read just before it."""
    grads = []
    step = worker.optimizer.step

    def recording_step(*args, **kwargs):
        grads.append(harness.main_grads(worker.model))
        return step(*args, **kwargs)

    worker.optimizer.step = recording_step
    result = worker.train(batched(batch), make_loss(TAG))
    return grads, result


def _reference(batch: dict, rows: slice):
    """NeMo-RL's loss over ``rows`` in one forward of fresh identical weights: (loss, gradient)."""
    gpt = harness.tiny_gpt()
    data = batched({k: v[rows] for k, v in batch.items()})
    mask = data["token_mask"][:, 1:] * data["sample_mask"][:, None]
    loss, _ = make_loss(TAG)(harness.direct_logprobs(gpt, data["input_ids"]), data,
                             global_valid_seqs=data["sample_mask"].sum(), global_valid_toks=mask.sum())
    loss.backward()
    return float(loss), torch.cat([p.grad.reshape(-1).double() for p in gpt.parameters()])


def _real_tokens(batch: dict) -> torch.Tensor:
    """Next-token positions inside each row (``[rows, seq - 1]``)."""
    return torch.arange(batch["input_ids"].shape[1])[None, 1:] < batch["input_lengths"][:, None]


@pytest.fixture(scope="module")
def noise() -> dict[str, float]:
    """bf16 (gpu tier): what re-batching the same 12 rows moves, the worker unpatched with 6 rows a
    micro-batch instead of 4 — log-probs (absolute), gradient (relative), summed loss; fp32: nothing."""
    if not BF16:
        return {"logprobs": 0.0, "grad": 0.0, "loss": 0.0}
    batch = make_batch(rows=12)
    (grads, result), (grads6, result6) = (_recorded_train(harness.real_worker(gbs=12, mbs=mbs), batch)
                                          for mbs in (4, 6))
    logprobs, logprobs6 = (harness.real_worker(gbs=12, mbs=mbs).get_logprobs(data=batched(batch))["logprobs"]
                           for mbs in (4, 6))
    return {"logprobs": float((logprobs6 - logprobs)[:, 1:][_real_tokens(batch)].abs().max()),
            "grad": rel(grads6[0], grads[0]),
            "loss": abs(sum(result6["all_mb_metrics"]["loss"]) - sum(result["all_mb_metrics"]["loss"]))}


def test_get_logprobs_matches_a_plain_forward(noise, record_property):
    batch = make_batch(rows=12)
    worker = harness.real_worker(gbs=12, mbs=4)
    logprobs = worker.get_logprobs(data=batched(batch))["logprobs"]
    with torch.no_grad():
        expected = harness.direct_logprobs(harness.tiny_gpt(), batch["input_ids"])
    assert logprobs.shape == batch["input_ids"].shape and (logprobs[:, 0] == 0).all()
    error = float((logprobs[:, 1:] - expected)[_real_tokens(batch)].abs().max())
    record_property("megatron_worker_logprob_vs_plain_abs", error)
    assert error <= max(1e-5, 2 * noise["logprobs"]), (error, noise)


def test_train_gradient_is_nemo_loss_over_the_global_batch(noise, record_property):
    batch = make_batch(rows=12)
    grads, result = _recorded_train(harness.real_worker(gbs=12, mbs=4), batch)  # 3 micro-batches, one step
    loss, expected = _reference(batch, slice(0, 12))
    assert len(grads) == 1 and expected.norm() > 0
    error = rel(grads[0], expected)
    record_property("megatron_worker_grad_vs_plain_rel", error)
    record_property("megatron_worker_rebatching_noise_grad_rel", noise["grad"])  # 0 in fp32 (not measured)
    assert error <= tolerance(noise["grad"]), (error, noise)
    assert len(result["all_mb_metrics"]["loss"]) == 3
    assert abs(sum(result["all_mb_metrics"]["loss"]) - loss) <= max(1e-6 * max(1.0, abs(loss)), 2 * noise["loss"])


def test_two_global_batches_step_twice(noise):
    batch = make_batch(rows=12)
    worker = harness.real_worker(gbs=6, mbs=2)
    grads, result = _recorded_train(worker, batch)
    assert len(grads) == 2 and len(result["all_mb_metrics"]["loss"]) == 6
    _, first = _reference(batch, slice(0, 6))  # the first step starts from the initial weights
    assert rel(grads[0], first) <= tolerance(noise["grad"])
