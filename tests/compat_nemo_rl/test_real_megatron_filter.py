"""The zero-advantage filter in NeMo-RL's real Megatron policy worker (v0.7.0), on a CPU.

``MegatronPolicyWorkerImpl.train`` of the NeMo-RL source on the path runs on a tiny megatron-core
``GPTModel`` (:mod:`tests.helpers.nemo_rl_megatron_harness`) twice from the same weights, patched
and unpatched: the gradient of every optimizer step is equal (fp32, rel <= 1e-6), fewer rows go
through the autograd forward (counted), the loss NeMo-RL reports is unchanged, and the filter's
counters are in its metrics. A planted fault (the naive filter: the kept rows' loss renormalised by
the kept tokens and rows) fails the same comparison; ``GRPO_PATCHES_PLANTED_FAULT=renormalise``
plants it in every patched run here (the exactness tests must then fail). Skips without a NeMo-RL
source (v0.7.0) or Megatron-Bridge on the path. main's split train step (``begin_train_step`` /
``train_microbatch`` / ``finish_train_step``, NeMo-RL's data plane) is not filtered: with ``"auto"`` it runs
NeMo-RL's gradient and ``status()`` says so, with ``True`` it raises before any micro-batch trains.

The gpu tier runs the same tests in bf16 (:mod:`tests.helpers.megatron_tier`) and compares with the noise
floor: twice what re-batching the same rows moves unpatched (3 rows a micro-batch instead of 2); on the cpu
tier one test runs that bf16 comparison on local layers, so the gpu tier's path is exercised without a GPU.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import pytest
import torch

import grpo_patches
from grpo_patches.errors import IncompatibleOptionsError
from grpo_patches_testing.nemo_rl_cpu import tag
from grpo_patches_testing.nemo_rl_tags import make_loss
from tests.compat_nemo_rl.megatron_dp2 import run_ranks
from tests.helpers import nemo_rl_megatron_harness as harness
from tests.helpers.megatron_tier import BF16, FP32_TOL, skip_unless_gpus
from tests.helpers.megatron_tier import tolerance as noise_tolerance
from tests.helpers.nemo_worker_harness import ZERO_ROWS, batched, make_batch, rel

WORKER = harness.setup()  # skips the module without a NeMo-RL source or Megatron-Bridge
TAG = tag()
PLANTED_FAULT = os.environ.get("GRPO_PATCHES_PLANTED_FAULT")


@dataclass
class Run:
    step_grads: list[torch.Tensor]
    metrics: dict[str, list]
    rows_forwarded: int  # rows through the autograd forward


@dataclass
class Tolerance:
    grad: float  # relative, per optimizer step
    loss: float  # absolute, NeMo-RL's summed loss


@contextmanager
def renormalising_filter() -> Iterator[None]:
    """The planted fault: each global batch's loss divided by its kept (non-zero-advantage) tokens and
    rows instead of NeMo-RL's unfiltered counts."""
    original = WORKER.process_global_batch

    def faulty(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        batch = result["batch"]
        kept = (batch["advantages"] != 0).any(dim=1).float() * batch["sample_mask"]
        mask = batch["token_mask"][:, 1:] * kept[:, None]
        result["global_valid_toks"] = mask.sum()
        result["global_valid_seqs"] = kept.sum()
        return result

    WORKER.process_global_batch = faulty
    try:
        yield
    finally:
        WORKER.process_global_batch = original


@contextmanager
def rows_forwarded(worker: Any, rows: list[int] | None = None) -> Iterator[list[int]]:
    """``rows`` (a fresh ``[0]`` unless given) counts the rows through ``worker``'s autograd forward inside."""
    rows = [0] if rows is None else rows

    def count(module: Any, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled():
            rows[0] += int(kwargs.get("input_ids", args[0] if args else None).shape[0])

    handle = worker.model.module.register_forward_pre_hook(count, with_kwargs=True)
    try:
        yield rows
    finally:
        handle.remove()


def _train(batch: dict, gbs: int, mbs: int, fault: bool = False, bf16: bool = BF16) -> Run:
    worker = harness.real_worker(gbs=gbs, mbs=mbs, bf16=bf16)
    grads = harness.record_grads(worker)
    with rows_forwarded(worker) as rows:
        if fault or (PLANTED_FAULT == "renormalise" and grpo_patches.status()["nemo_rl"]["patched"]):
            with renormalising_filter():
                result = worker.train(batched(batch), make_loss(TAG))
        else:
            result = worker.train(batched(batch), make_loss(TAG))
    return Run(grads, result["all_mb_metrics"], rows[0])


def noise_floor(bf16: bool) -> Tolerance:
    """fp32: 1e-6. bf16: twice what re-batching the same rows (3 a micro-batch instead of 2) moves, unpatched."""
    if not bf16:
        return Tolerance(FP32_TOL, 1e-6)
    grpo_patches.disable("nemo_rl")
    base, rebatched = (_train(make_batch(rows=12), gbs=6, mbs=mbs, bf16=True) for mbs in (2, 3))
    return Tolerance(noise_tolerance(_max_rel(rebatched, base)),
                     max(1e-6, 2 * abs(sum(rebatched.metrics["loss"]) - sum(base.metrics["loss"]))))


@pytest.fixture(scope="module")
def tolerance() -> Tolerance:
    return noise_floor(BF16)


@pytest.fixture()
def unpatched() -> Run:
    grpo_patches.disable("nemo_rl")
    return _train(make_batch(rows=12), gbs=6, mbs=2)


@pytest.fixture()
def enabled():
    def enable(**options: Any) -> None:
        grpo_patches.enable("nemo_rl", **options)

    yield enable
    grpo_patches.disable("nemo_rl")


def _max_rel(a: Run, b: Run) -> float:
    assert len(a.step_grads) == len(b.step_grads) == 2
    return max(rel(x, y) for x, y in zip(a.step_grads, b.step_grads))


def test_filter_gradients_equal_unpatched_with_fewer_rows(unpatched, enabled, tolerance, record_property):
    enabled(zero_advantage_filter=True)
    patched = _train(make_batch(rows=12), gbs=6, mbs=2)  # two global batches: two optimizer steps
    error = _max_rel(patched, unpatched)
    record_property("exact_megatron_filter_grad_rel", error)
    record_property("saved_megatron_filter_autograd_rows", unpatched.rows_forwarded - patched.rows_forwarded)
    record_property("megatron_filter_tolerance_grad_rel", tolerance.grad)  # 1e-6, or bf16's noise floor
    assert error <= tolerance.grad, (error, tolerance)
    assert unpatched.rows_forwarded == 12 and patched.rows_forwarded == 12 - len(ZERO_ROWS)
    assert len(unpatched.metrics["loss"]) == 6 and len(patched.metrics["loss"]) == 4  # 3 -> 2 micro-batches each
    assert abs(sum(patched.metrics["loss"]) - sum(unpatched.metrics["loss"])) <= tolerance.loss
    assert patched.metrics["grpo_patches/rows_dropped"] == [float(len(ZERO_ROWS))]
    assert patched.metrics["grpo_patches/micro_batches_dropped"] == [2.0]
    assert grpo_patches.status()["nemo_rl"]["notes"]["zero_advantage_filter"].startswith("on")


def test_planted_fault_renormalising_by_kept_tokens_fails(unpatched, enabled, tolerance, record_property):
    enabled(zero_advantage_filter=True)
    faulty = _train(make_batch(rows=12), gbs=6, mbs=2, fault=True)
    error = _max_rel(faulty, unpatched)
    record_property("fault_renormalised_grad_rel_nemo_megatron", error)
    assert error > max(1e-2, tolerance.grad), (error, tolerance)


def test_uncovered_setting_auto_notes_and_true_refuses(unpatched, enabled, tolerance):
    enabled(zero_advantage_filter="auto", dropped_rows_metrics=True)
    run = _train(make_batch(rows=12), gbs=6, mbs=2)
    note = grpo_patches.status()["nemo_rl"]["notes"]["zero_advantage_filter"]
    assert note.startswith("off:") and "dropped_rows_metrics=True" in note, note
    assert run.rows_forwarded == 12 and _max_rel(run, unpatched) <= tolerance.grad
    grpo_patches.disable("nemo_rl")
    enabled(zero_advantage_filter=True, dropped_rows_metrics=True)
    with pytest.raises(IncompatibleOptionsError, match="Megatron worker"):
        _train(make_batch(rows=12), gbs=6, mbs=2)


def test_get_logprobs_sees_every_row(enabled):
    batch = make_batch(rows=12)
    grpo_patches.disable("nemo_rl")
    expected = harness.real_worker(gbs=12, mbs=4).get_logprobs(data=batched(batch))["logprobs"]
    enabled(zero_advantage_filter=True)
    got = harness.real_worker(gbs=12, mbs=4).get_logprobs(data=batched(batch))["logprobs"]
    assert torch.equal(got, expected)


@pytest.mark.skipif(BF16, reason="the gpu tier (or GRPO_PATCHES_MEGATRON_BF16=1) runs every test here in bf16")
def test_bf16_path_of_the_gpu_tier_on_cpu(enabled, record_property):
    """The gpu tier's comparison run on a CPU (local layers, bf16 weights in ``Float16Module``, bf16 DDP
    gradients): re-batching does move a bf16 gradient (the floor is measured, not fp32's 1e-6), the filter
    stays inside the floor, the planted fault lands far outside it."""
    floor = noise_floor(bf16=True)
    ref = _train(make_batch(rows=12), gbs=6, mbs=2, bf16=True)
    enabled(zero_advantage_filter=True)
    got = _train(make_batch(rows=12), gbs=6, mbs=2, bf16=True)
    faulty = _train(make_batch(rows=12), gbs=6, mbs=2, fault=True, bf16=True)
    error, fault = _max_rel(got, ref), _max_rel(faulty, ref)
    record_property("bf16_cpu_megatron_filter_grad_rel", error)
    record_property("bf16_cpu_megatron_noise_floor", floor.grad)
    record_property("fault_renormalised_grad_rel_nemo_megatron_bf16_cpu", fault)
    assert floor.grad > 1e-4, floor  # bf16 rounding, far above fp32's 1e-6
    assert error <= floor.grad and got.rows_forwarded == 12 - len(ZERO_ROWS), (error, floor)
    assert abs(sum(got.metrics["loss"]) - sum(ref.metrics["loss"])) <= floor.loss, floor
    assert fault > max(1e-2, floor.grad), (fault, floor)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_data_parallel_ranks_stay_aligned(record_property):
    """megatron-core DDP over two gloo ranks whose shards keep different numbers of rows: both run
    the same number of micro-batches (their gradient all-reduces pair up), and the gradients are NeMo-RL's
    (bf16 on the gpu tier: within each rank's re-batching noise floor)."""
    skip_unless_gpus(2)
    results = run_ranks(multiprocessing.get_context("spawn"), _free_port())
    for rank in results:
        record_property(f"exact_megatron_filter_dp2_rank{rank['rank']}_grad_rel", rank["grad_rel"])
        record_property(f"saved_megatron_filter_dp2_rank{rank['rank']}_autograd_rows",
                        rank["rows_base"] - rank["rows_patched"])
        assert rank["grad_rel"] <= rank["tol"], rank
        assert rank["rows_patched"] < rank["rows_base"] == 6, rank
    assert results[0]["microbatches"] == results[1]["microbatches"] < results[0]["microbatches_base"]
    assert sum(r["rows_dropped"] for r in results) > 0


SPLIT_STEP = hasattr(WORKER.MegatronPolicyWorkerImpl, "begin_train_step")  # main: NeMo-RL's data plane


def _split_train(batch: dict, gbs: int, mbs: int, chunks: int, rows: list[int] | None = None) -> Run:
    """main's split train step on the real worker, as the data plane drives it: per global batch of ``gbs``
    rows ``begin_train_step``, ``train_microbatch`` on ``chunks`` consecutive slices, ``finish_train_step``
    (its deferred all-reduce of the valid counts, ``scale_gradients(1 / N)`` and the relocated
    ``finalize_model_grads``, which Megatron-Bridge binds on the model config); ``rows`` gets the rows
    through the autograd forward as they go (read after an error)."""
    from megatron.core.distributed import finalize_model_grads

    worker = harness.real_worker(gbs=gbs, mbs=mbs)
    worker.cfg["megatron_cfg"]["distributed_data_parallel_config"] = {"overlap_grad_reduce": False}
    worker.model.config.finalize_model_grads_func = finalize_model_grads
    grads = harness.record_grads(worker)
    metrics: dict[str, list] = {}
    loss_fn = make_loss(TAG)
    data = batched(batch)
    size = gbs // chunks
    try:
        with rows_forwarded(worker, rows) as rows:
            for start in range(0, int(data["input_ids"].shape[0]), gbs):
                worker.begin_train_step(loss_fn, gbs=gbs, mbs=mbs)
                for chunk in range(start, start + gbs, size):
                    worker.train_microbatch(data.slice(chunk, chunk + size))
                for key, values in worker.finish_train_step()["all_mb_metrics"].items():
                    metrics.setdefault(key, []).extend(values)
    finally:
        worker.abort_train_step()  # a no-op after finish; drops a step an error left open
    return Run(grads, metrics, rows[0])


@pytest.mark.skipif(not SPLIT_STEP, reason="main's split train step (begin / train_microbatch / finish)")
def test_split_train_step_auto_notes_and_true_refuses_before_training(unpatched, enabled, tolerance,
                                                                      record_property):
    """main's split train step runs unfiltered on the real worker: ``"auto"`` says so in ``status()`` and
    leaves the gradient NeMo-RL's (the split step unpatched; and within fp32 of ``train()``'s, which divides
    each micro-batch by the global counts instead of the summed gradient once); ``True`` raises the one
    clear error at the first ``train_microbatch``, before any micro-batch trains."""
    base = _split_train(make_batch(rows=12), gbs=6, mbs=2, chunks=3)
    assert len(base.step_grads) == 2 and base.rows_forwarded == 12
    train_rel = _max_rel(base, unpatched)
    record_property("megatron_split_step_vs_train_grad_rel", train_rel)
    assert train_rel <= tolerance.grad, (train_rel, tolerance)
    enabled(zero_advantage_filter="auto")
    noted = _split_train(make_batch(rows=12), gbs=6, mbs=2, chunks=3)
    note = grpo_patches.status()["nemo_rl"]["notes"]["zero_advantage_filter"]
    assert "split train step" in note and "unfiltered" in note, note
    error = _max_rel(noted, base)
    record_property("exact_megatron_split_step_auto_grad_rel", error)
    assert error <= tolerance.grad and noted.rows_forwarded == 12, (error, tolerance)
    assert sum(noted.metrics["loss"]) == pytest.approx(sum(base.metrics["loss"]), abs=tolerance.loss)
    grpo_patches.disable("nemo_rl")
    enabled(zero_advantage_filter=True)
    forwarded = [0]
    with pytest.raises(IncompatibleOptionsError, match="split train step") as raised:
        _split_train(make_batch(rows=12), gbs=6, mbs=2, chunks=3, rows=forwarded)
    assert any(entry.name == "train_microbatch" for entry in raised.traceback) and forwarded == [0]
