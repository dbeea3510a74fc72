"""verl's Megatron engine (0.8+) with the patches off and on: the real ``TrainingWorker`` on
``MegatronEngineWithLMHead`` (mbridge, megatron-core, tiny Qwen2, fp32, gloo on CPU).

Equal, patched vs unpatched: the number of optimizer steps and the gradient before each
(Megatron's ``main_grad`` after its data-parallel reduction; max relative difference <= 1e-6)
for every agg mode, static and dynamic micro-batches, 1 and 2 mini-batches, and for tensor
parallel 2, pipeline parallel 2 (the 1F1B schedule) and data parallel 2 (two spawned processes
each), plus Megatron's per-token loss (``calculate_per_token_loss``). Counted: rows through the
model with autograd (16 -> 8 per rank). A planted fault (the naive filter: the kept rows' loss
renormalised by the kept tokens) fails the same comparison.

The tiled loss (tensor parallel 1, ``use_fused_kernels=True``): its answer to verl's fused forward's
``linear_cross_entropy`` call against verl's own unfused Megatron loss (verl's Triton kernel cannot
run on a CPU), per-step gradients <= 1e-6, every training micro-batch counted, the output layer's
projection never run; a wrong temperature or token weight fails; tensor parallel 2 refused / noted.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from grpo_patches_testing import verl_actor_runs as h

from grpo_patches_testing import verl_engine_runs as engine_runs

if h.VERL is None or h.line() != "engine" or importlib.util.find_spec("megatron.core") is None \
        or importlib.util.find_spec("mbridge") is None:
    pytest.skip("verl >= 0.8 with megatron-core and mbridge is not installed (the Megatron compat cells install "
                "them)", allow_module_level=True)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from tests.helpers import verl_megatron_harness as mh  # noqa: E402
from tests.helpers import verl_megatron_tiled as tc  # noqa: E402
from tests.helpers.megatron_tier import skip_unless_gpus, tolerance as noise_tolerance  # noqa: E402

TOL = 1e-6  # fp32 (cpu tier); the gpu tier (bf16) compares with the re-batching noise floor (tolerance())
FILTER = {"zero_advantage_filter": True, "logprob_skip": False}
LAYOUTS = [(False, 1, "grouped"), (False, 2, "interleaved"), (True, 1, "interleaved"), (True, 2, "grouped")]
KEPT = 8  # rows with a non-zero advantage per rank


def _per_token_loss_path() -> bool:
    """verl 0.9+ returns Megatron's per-token triple from its loss (0.8.0 has no such path)."""
    from verl.workers.engine.megatron.transformer_impl import MegatronEngine

    return hasattr(MegatronEngine, "_routed_num_tokens")


PER_TOKEN = pytest.mark.skipif(not _per_token_loss_path(), reason="verl 0.8.0 has no per-token loss path")


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """One Megatron worker per micro-batching, and one with Megatron's per-token loss (reset between runs)."""
    torch.set_num_threads(2)
    mh.setup()
    path = mh.model_dir(str(tmp_path_factory.mktemp("verl_megatron_model")))
    built = {dynamic: mh.MegatronWorker(path, dynamic=dynamic) for dynamic in (False, True)}
    if _per_token_loss_path():
        built["per_token"] = mh.MegatronWorker(path, per_token=True)
    return built


@pytest.fixture(scope="module")
def tolerance(workers):
    """1e-6 in fp32; in bf16 twice the gradient change that merely re-batching the same rows makes
    (static vs dynamic micro-batches, unpatched), and never below 1e-6."""
    if not mh.GPU:
        return TOL
    return noise_tolerance(h.max_rel(workers[True].run(None), workers[False].run(None)))


@pytest.mark.parametrize("dynamic,n_mini,zero", LAYOUTS)
@pytest.mark.parametrize("agg", h.AGG_MODES)
def test_filter_is_exact_and_skips_the_dropped_rows(workers, tolerance, agg, dynamic, n_mini, zero,
                                                    record_property):
    ref = workers[dynamic].run(None, agg=agg, n_mini=n_mini, zero=zero)
    got = workers[dynamic].run(FILTER, agg=agg, n_mini=n_mini, zero=zero)
    err = h.max_rel(got, ref)  # asserts the same number of optimizer steps
    record_property("exact_megatron_filter_grad_rel_ws1", err)
    record_property("saved_megatron_autograd_rows_ws1", ref.grad_rows - got.grad_rows)
    assert err <= tolerance, (agg, dynamic, n_mini, zero, err, tolerance)
    assert ref.grad_rows == h.ROWS and got.grad_rows == KEPT, (ref.grad_rows, got.grad_rows)
    assert got.forwards < ref.forwards
    assert sum(got.metrics["actor/pg_loss"]) == pytest.approx(sum(ref.metrics["actor/pg_loss"]), rel=1e-5, abs=1e-7)
    assert sum(got.metrics["grpo_patches/rows_dropped"]) == KEPT
    assert "actor/pg_clipfrac/kept_rows" in got.metrics and "actor/pg_clipfrac" not in got.metrics
    assert got.status["savings"]["rows_dropped"] == KEPT


@PER_TOKEN
def test_per_token_loss_keeps_megatrons_token_count(workers, tolerance, record_property):
    """``calculate_per_token_loss``: Megatron divides by the micro-batches' accumulated token count."""
    ref = workers["per_token"].run(None)
    got = workers["per_token"].run(FILTER)
    err = h.max_rel(got, ref)
    record_property("exact_megatron_filter_per_token_grad_rel", err)
    assert err <= tolerance and got.grad_rows == KEPT, (err, got.grad_rows)


@pytest.mark.parametrize("kind", ["plain", pytest.param("per_token", marks=PER_TOKEN)])
def test_a_planted_fault_fails_the_comparison(workers, kind, monkeypatch, record_property):
    """The naive filter (kept rows, the loss renormalised by the kept tokens) is caught."""
    from grpo_patches.adapters.verl import zero_advantage_engine

    worker = workers[False if kind == "plain" else kind]
    ref = worker.run(None)
    monkeypatch.setattr(zero_advantage_engine, "forward_backward_batch", mh.renormalising_filter)
    got = worker.run(FILTER)
    err = h.max_rel(got, ref)
    record_property(f"fault_renormalised_grad_rel_{kind}", err)
    assert err > 1e-3 and got.grad_rows == KEPT, err


def test_reference_placeholder_at_kl_coefficient_zero(workers, record_property):
    """No ``ref_log_prob`` (the pass was skipped): the placeholder, times ``kl_loss_coef=0``, bitwise."""
    ref = workers[False].run(None, use_kl_loss=True, kl_loss_coef=0.0,
                             batch_extra={"ref_log_prob": h.make_batch()["old_log_probs"] - 0.2})
    got = workers[False].run({"logprob_skip": True, "zero_advantage_filter": False}, use_kl_loss=True,
                             kl_loss_coef=0.0)
    err = h.max_rel(got, ref)
    record_property("exact_megatron_reference_skip_grad_rel", err)
    assert err == 0.0 and "kl_loss" not in got.metrics and "actor/kl_loss" not in got.metrics
    assert got.status["savings"]["reference_passes_skipped"] == 1


def test_on_policy_update_skips_the_old_logprob_pass(workers, tolerance, monkeypatch, record_property):
    """v0 ``RayPPOTrainer._compute_old_log_prob`` (real) on the Megatron worker, then its update."""
    monkeypatch.setattr(engine_runs, "shared_worker", lambda: workers[False])
    ref = engine_runs.old_pass_then_update(None)
    got = engine_runs.old_pass_then_update({"logprob_skip": True, "zero_advantage_filter": False})
    err = h.max_rel(got, ref)
    record_property("exact_megatron_old_logprob_skip_grad_rel", err)
    assert err <= tolerance and ref.forwards == 1 and got.forwards == 0, (err, ref.forwards, got.forwards)
    (entropy,) = got.metrics["actor/entropy"]  # the update's own forward, aggregated as the trainer does
    assert entropy == pytest.approx(ref.metrics["trainer/actor/entropy"], rel=1e-6)
    assert got.status["savings"]["old_logprob_passes_skipped"] == 1


def test_auto_notes_what_megatron_does_not_cover(workers):
    got = workers[False].run({"zero_advantage_filter": "auto", "dropped_rows_metrics": True, "tiled_loss": "auto"})
    notes = " ".join(n for by_class in got.status["by_class"].values() for n in by_class.values())
    assert "dropped_rows_metrics=True is not available on verl's Megatron engine" in notes
    assert "use_fused_kernels=False" in notes  # the tiled loss keeps verl's own loss, and says so
    assert got.grad_rows == h.ROWS and "tiled_loss_micro_batches" not in got.status["savings"]


# --- the tiled loss: verl's fused Megatron forward (TP = 1) answered tile by tile -----------------

@pytest.fixture(scope="module")
def fused_worker(workers, tmp_path_factory):
    """A worker on verl's fused Megatron forward (packed sequences). Its Triton kernel cannot run on a
    CPU: every patched update below runs without it, and the reference is verl's unfused Megatron loss."""
    return mh.MegatronWorker(mh.model_dir(str(tmp_path_factory.mktemp("verl_megatron_fused"))), fused=True)


@pytest.mark.parametrize("agg,n_mini,entropy", [("token-mean", 1, False), ("seq-mean-token-sum", 2, True),
                                                ("seq-mean-token-mean", 1, False),
                                                ("seq-mean-token-sum-norm", 2, False)])
def test_tiled_loss_matches_verls_megatron_loss(workers, fused_worker, tolerance, agg, n_mini, entropy,
                                                record_property):
    """Per-step gradients equal to verl's own (unfused) Megatron loss; every training micro-batch through the
    tiled loss; the output layer's [tokens, vocab] projection never runs in the tiled update."""
    extra = dict(entropy_coeff=0.01, calculate_entropy=True) if entropy else {}
    tc.check(workers[False], fused_worker, record_property, record="tiled", tolerance=tolerance, agg=agg,
             n_mini=n_mini, **extra)


@pytest.mark.parametrize("fault", tc.FAULTS)
def test_a_planted_tiled_fault_fails_the_comparison(workers, fused_worker, fault, monkeypatch, record_property):
    """A wrong temperature or a wrong token weight in the tiled loss is caught by the same comparison."""
    tc.check(workers[False], fused_worker, record_property, record="tiled", tolerance=TOL, fault=fault,
             monkeypatch=monkeypatch)


def test_tiled_true_refuses_tensor_parallel_and_auto_notes_it(workers, fused_worker, monkeypatch):
    """TP > 1 splits the vocabulary: ``True`` raises before any micro-batch, ``"auto"`` keeps verl's loss with
    the reason (the decision reads the engine's settings: TP 2 is set on the TP = 1 workers' configs)."""
    for worker in (fused_worker, workers[False]):
        monkeypatch.setitem(vars(worker.engine.engine_config), "tensor_model_parallel_size", 2)  # a frozen config
    from grpo_patches.errors import IncompatibleOptionsError

    with pytest.raises(IncompatibleOptionsError, match="tensor_model_parallel_size=2") as raised:
        fused_worker.run(tc.TILED)
    assert fused_worker.current is None and "splits the vocabulary" in str(raised.value)
    got = workers[False].run({**tc.TILED, "tiled_loss": "auto"})  # verl's own (unfused) loss, noted
    assert "tensor_model_parallel_size=2" in tc.notes(got) and "tiled_loss_micro_batches" not in got.status["savings"]


# --- two processes: tensor parallel 2, pipeline parallel 2, data parallel 2 ----------------------

TOPOLOGIES = {"tp2": dict(tp=2), "pp2": dict(pp=2), "dp2": dict()}
MULTI = [("token-mean", False, 2, "interleaved"), ("seq-mean-token-mean", True, 1, "grouped"),
         ("seq-mean-token-sum-norm", False, 1, "grouped")]


def _two_process_worker(rank: int, port: int, out_dir: str, model_path: str, topology: str) -> None:
    torch.set_num_threads(1)
    mh.setup(rank, 2, port)
    shape = TOPOLOGIES[topology]
    dp = 2 if topology == "dp2" else 1
    workers = {d: mh.MegatronWorker(model_path, dynamic=d, **shape) for d in (False, True)}
    noise = h.max_rel(workers[True].run(None), workers[False].run(None)) if mh.GPU else 0.0  # bf16: re-batching
    results = []
    for agg, dynamic, n_mini, zero in MULTI:
        kw = dict(agg=agg, n_mini=n_mini, zero=zero, dp_rank=rank if dp == 2 else 0, dp=dp)
        ref = workers[dynamic].run(None, **kw)
        got = workers[dynamic].run(FILTER, **kw)
        results.append({"config": [agg, dynamic, n_mini, zero], "err": h.max_rel(got, ref), "steps": len(got.grads),
                        "forwards": got.forwards, "ref_forwards": ref.forwards, "grad_rows": got.grad_rows,
                        "ref_grad_rows": ref.grad_rows, "tol": noise_tolerance(noise)})
    with open(os.path.join(out_dir, f"{topology}-rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def two_process_results(request, tmp_path_factory):
    skip_unless_gpus(2)
    out = tmp_path_factory.mktemp(f"verl_megatron_{request.param}")
    path = mh.model_dir(str(out))
    mp.spawn(_two_process_worker, args=(h.free_port(), str(out), path, request.param), nprocs=2, join=True)
    return request.param, [json.loads((out / f"{request.param}-rank{r}.json").read_text()) for r in range(2)]


def test_two_processes_exact_with_identical_schedules(two_process_results, record_property):
    topology, (rank0, rank1) = two_process_results
    for a, b in zip(rank0, rank1):
        assert a["err"] <= a["tol"] and b["err"] <= b["tol"], (topology, a, b)
        # every stage / TP rank / DP rank runs the same micro-batches (a pipeline schedule hangs otherwise)
        assert a["steps"] == b["steps"] and a["forwards"] == b["forwards"], (topology, a, b)
        assert a["forwards"] < a["ref_forwards"] and a["grad_rows"] < a["ref_grad_rows"], (topology, a)
    record_property(f"exact_megatron_filter_grad_rel_{topology}", max(r["err"] for r in rank0 + rank1))
    record_property(f"saved_megatron_autograd_rows_{topology}", rank0[0]["ref_grad_rows"] - rank0[0]["grad_rows"])
