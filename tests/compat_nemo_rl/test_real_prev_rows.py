"""The prev-logprob pass cut to the rows some loss reads (``recompute``), on the real worker of the tag.

The cases are the stand-in's (:mod:`tests.helpers.nemo_prev_rows_cases`); here the pass is the
real worker's ``get_logprobs`` on the sub-batch, and the batch reaches ``train()`` cut by
NeMo-RL's own ``shard_by_batch_size`` (dynamic batching sorts inside each global batch; two
data-parallel ranks, FSDP2, take their share of each).
"""

from __future__ import annotations

import multiprocessing
import socket

import pytest

import grpo_patches
from grpo_patches.adapters.nemo_rl import old_logprob_rows
from grpo_patches_testing import nemo_rl_cpu as harness
from tests.helpers import nemo_prev_rows_cases as cases

TAG = harness.setup()
harness.need_worker()


@pytest.fixture(autouse=True)
def _clean():
    yield
    grpo_patches.disable()


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("global_batches", [1, 2, 4])
def test_deferred_pass_matches_upstream(global_batches, dynamic, record_property):
    got = cases.deferred_matches_upstream(TAG, harness.real_worker, global_batches, dynamic=dynamic)
    record_property(f"exact_prev_rows_{global_batches}gb_{'dyn' if dynamic else 'static'}_grad_rel", got["grad_rel"])
    record_property(f"prev_rows_computed_{global_batches}gb", f"{got['computed']}/{cases.ROWS}")
    assert got["steps"] == global_batches
    assert got["grad_rel"] <= cases.TOL
    assert got["skipped"] == cases.expected_skipped(global_batches, True) == got["nan_rows"]


def test_without_the_filter_only_the_first_step_skips(record_property):
    got = cases.deferred_matches_upstream(TAG, harness.real_worker, 2, zero_filter=False)
    record_property("exact_prev_rows_no_filter_grad_rel", got["grad_rel"])
    assert got["grad_rel"] <= cases.TOL and got["skipped"] == 8


def test_wrong_rows_treated_as_first_are_caught(monkeypatch, record_property):
    monkeypatch.setattr(old_logprob_rows, "plan", cases.rows_treated_as_first(8))
    got = cases.deferred_matches_upstream(TAG, harness.real_worker, 2, zero_filter=False)
    record_property("fault_prev_rows_grad_rel", got["grad_rel"])
    assert got["grad_rel"] > 1e3 * cases.TOL


def _rank(rank: int, port: int, queue, dynamic: bool) -> None:
    try:
        import torch

        torch.set_num_threads(1)
        tag = harness.setup()
        harness.init_gloo(rank, 2, port)

        def factory(t: str, gbs: int, mbs: int, dynamic: bool = False, dp: int = 1):
            return harness.real_worker(t, gbs, mbs, dynamic=dynamic, fsdp=True, dp=2)

        got = cases.deferred_matches_upstream(tag, factory, 2, dynamic=dynamic, dp=2, rank=rank, lookup=True)
        queue.put({"rank": rank, **got})
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        queue.put({"rank": rank, "error": repr(exc)})
        raise


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_two_data_parallel_ranks(dynamic, record_property):
    """Each rank trains its share of every global batch (NeMo-RL's sharding), FSDP2 over the two."""
    context = multiprocessing.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = context.Queue()
    procs = [context.Process(target=_rank, args=(rank, port, queue, dynamic)) for rank in range(2)]
    for proc in procs:
        proc.start()
    results = sorted((queue.get(timeout=900) for _ in procs), key=lambda r: r["rank"])
    for proc in procs:
        proc.join(timeout=60)
    assert not [r["error"] for r in results if "error" in r]
    worst = max(r["grad_rel"] for r in results)
    record_property(f"exact_prev_rows_dp2_{'dyn' if dynamic else 'static'}_grad_rel", worst)
    assert worst <= cases.TOL
    assert all(r["skipped"] == cases.expected_skipped(2, True, dp=2) for r in results)


@pytest.mark.skipif(TAG == "v0.5.0", reason="verify mode needs NeMo-RL >= 0.6.0 (v0.5.0 refuses verify_every)")
def test_a_verify_step_compares_the_skipped_rows(record_property):
    from grpo_patches.errors import ExactnessError
    from tests.helpers.nemo_verify_cases import PREFIX
    from tests.helpers.nemo_worker_harness import max_grad_rel

    base, verified = cases.verify_step(TAG, harness.real_worker)
    figure = max(verified.metrics[PREFIX + "old_logprob_max_abs_diff"])
    record_property("exact_prev_rows_verify_old_logprob_max_abs_diff", figure)
    assert figure <= 1e-5 and max(verified.metrics[PREFIX + "grad_rel_diff"]) <= 1e-5
    assert verified.status["verify"]["failures"] == [] and max_grad_rel(verified, base) <= cases.TOL
    with pytest.raises(ExactnessError, match="old_logprob_max_abs_diff"):
        cases.verify_step(TAG, harness.real_worker, first_rows_off=0.01)


def _dropout_worker():
    """The real worker with a tiny Qwen2 whose attention dropout (0.5) makes train-mode forwards differ."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    worker = harness.real_worker(TAG, 4, 2)
    config = Qwen2Config(vocab_size=23, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.5)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    worker.model = Qwen2ForCausalLM(config).float()
    worker.optimizer = torch.optim.SGD(worker.model.parameters(), lr=0.1)
    return worker


def test_the_pass_needs_no_inference_bracket(monkeypatch):
    """What lets the deferred pass run without ``prepare_for_lp_inference`` / ``prepare_for_training``
    around it (adapters/nemo_rl/pass_bracket.py): the worker's ``get_logprobs`` puts the model in eval
    mode itself (same values from a model left in training mode, bitwise), and ``train()`` puts it
    back in training mode before its first forward. Planted fault: a model whose ``eval()`` does
    nothing gives other values (dropout), so the comparison can fail."""
    import torch

    from tests.helpers.nemo_worker_harness import batched, make_batch, make_loss

    worker = _dropout_worker()
    data = batched(make_batch(rows=4, zero_rows=()))
    worker.model.eval()
    bracketed = worker.get_logprobs(batched(data))["logprobs"]
    worker.model.train()  # as grpo_train's prepare_for_training leaves it
    bare = worker.get_logprobs(batched(data))["logprobs"]
    assert torch.equal(bare, bracketed)
    assert not worker.model.training  # left in eval mode: train() must switch back
    modes = []
    hook = worker.model.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    try:
        worker.train(batched(data), make_loss(TAG))
    finally:
        hook.remove()
    assert modes and all(modes)
    worker = _dropout_worker()
    monkeypatch.setattr(worker.model, "eval", lambda: worker.model)  # the planted fault
    worker.model.train()
    torch.manual_seed(1)
    assert not torch.allclose(worker.get_logprobs(batched(data))["logprobs"], bracketed, atol=1e-4)
