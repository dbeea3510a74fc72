"""The zero-advantage filter in real verl: patches off vs on, the gradient at every optimizer step.

Legacy line (0.6.1-0.7.1): ``DataParallelPPOActor.update_policy``; engine line (0.8.0-0.9.1):
``TrainingWorker.train_mini_batch`` on the FSDP2 engine with ``ppo_loss``. Tiny Qwen2, fp32,
gloo, 16 rows per rank of which 8 have advantage exactly 0 (a block, or spread over every
micro-batch), off-policy old log-probs so that ratios clip. Every agg mode, static and dynamic
micro-batches, 1 and 2 mini-batches; world size 1 and 2 (FSDP2, two spawned processes).
Equal: the number of optimizer steps and the gradient before each (max relative difference
<= 1e-6). Counted: the rows that went through the model with autograd (16 -> 8 per epoch).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from grpo_patches_testing import verl_actor_runs as h

from grpo_patches_testing import verl_engine_runs as engine_runs
from tests.helpers.verl_fixtures import process_group  # noqa: F401  (autouse: one process group per module)

if h.VERL is None:
    pytest.skip("verl is not installed (the compat cells install it)", allow_module_level=True)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from grpo_patches.errors import IncompatibleOptionsError  # noqa: E402

TOL = 1e-6
LINE = h.line()
LEGACY = LINE.startswith("legacy")
FILTER = {"zero_advantage_filter": True, "logprob_skip": False}
#: (dynamic micro-batches, mini-batches, zero-row layout): every pair of settings meets once per agg mode
LAYOUTS = [(False, 1, "grouped"), (False, 2, "interleaved"), (True, 1, "interleaved"), (True, 2, "grouped")]
KEPT = 8  # rows with a non-zero advantage per rank


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """Engine line: one FSDP2 worker per micro-batching (reset between runs)."""
    if LEGACY:
        return None
    path = h.model_dir(str(tmp_path_factory.mktemp("verl_model")))
    return {dynamic: engine_runs.EngineWorker(path, dynamic=dynamic) for dynamic in (False, True)}


def run(options, workers, *, dynamic=False, **kw) -> h.Run:
    if LEGACY:
        return h.legacy_run(options, dynamic=dynamic, **kw)
    return workers[dynamic].run(options, **kw)


@pytest.mark.parametrize("dynamic,n_mini,zero", LAYOUTS)
@pytest.mark.parametrize("agg", h.AGG_MODES)
def test_filter_is_exact_and_skips_the_dropped_rows(workers, agg, dynamic, n_mini, zero, record_property):
    ref = run(None, workers, agg=agg, dynamic=dynamic, n_mini=n_mini, zero=zero)
    got = run(FILTER, workers, agg=agg, dynamic=dynamic, n_mini=n_mini, zero=zero)
    err = h.max_rel(got, ref)  # asserts the same number of optimizer steps
    record_property("exact_filter_grad_rel_ws1", err)
    assert len(ref.grads) == n_mini and err <= TOL, err
    assert ref.grad_rows == h.ROWS and got.grad_rows == KEPT  # dropped rows: no forward, no backward
    assert got.nograd_rows == 0 and got.forwards < ref.forwards
    rows, calls = got.metrics["grpo_patches/rows_dropped"], got.metrics["grpo_patches/micro_batches_dropped"]
    assert (sum(rows) if isinstance(rows, list) else rows) == h.ROWS - KEPT
    assert (sum(calls) if isinstance(calls, list) else calls) == ref.forwards - got.forwards  # the calls saved


def test_several_epochs(workers, record_property):
    ref = run(None, workers, agg="token-mean", n_mini=2, epochs=2)
    got = run(FILTER, workers, agg="token-mean", n_mini=2, epochs=2)
    err = h.max_rel(got, ref)
    record_property("exact_filter_grad_rel_ws1", err)
    assert len(got.grads) == 4 and err <= TOL and got.grad_rows == 2 * KEPT


def test_a_wrong_row_weight_is_detected(workers):
    """The comparison is sharp: a plugin answering weights 0.1 % off fails it."""
    import grpo_patches
    from grpo_patches.zero_advantage import filter_zero_advantage

    class Skewed:
        @grpo_patches.hookimpl
        def grpo_filter_zero_advantage(self, advantages, mask, denominator, group):
            plan = filter_zero_advantage(advantages, mask, denominator, group=group)
            return type(plan)(plan.keep, plan.weights * 1.001, plan.rows_dropped, plan.tokens_dropped,
                              plan.padding_rows, None)

    ref = run(None, workers, agg="token-mean", n_mini=1)
    plugin = Skewed()
    grpo_patches.plugin_manager().register(plugin)
    try:
        got = run(FILTER, workers, agg="token-mean", n_mini=1)
    finally:
        grpo_patches.plugin_manager().unregister(plugin)
    if LEGACY:  # the legacy line carries each row's weight into verl's loss
        assert h.max_rel(got, ref) > 1e2 * TOL
    else:  # the engine's global denominators make every kept weight 1: a plugin's weights are not applied
        assert h.max_rel(got, ref) <= TOL


def test_pack_metrics_keep_verls_names_only_where_provably_equal(workers):
    ref = run(None, workers, agg="token-mean", n_mini=2)
    got = run(FILTER, workers, agg="token-mean", n_mini=2)
    # 0.6 logs one value per micro-batch (the trainer logs their mean), 0.7 a float sum
    pg_ref, pg_got = (torch.tensor(run.metrics["actor/pg_loss"], dtype=torch.float64).mean() for run in (ref, got))
    assert torch.allclose(pg_got, pg_ref, rtol=1e-5, atol=1e-7)
    for name in ("actor/pg_clipfrac", "actor/ppo_kl"):
        assert name in ref.metrics and name not in got.metrics and name + "/kept_rows" in got.metrics
    assert {"grpo_patches/rows_dropped", "grpo_patches/tokens_dropped"} <= set(got.metrics)


# --- the kept rows packed: as few micro-batches as they fill (engine line) ---------------------

PACK_MBS = 4  # verl's micro-batch size in the packing tests: kept counts 5, 3 + 2, 2 + 1 + 1 + 1 are no multiple of it


@pytest.fixture(scope="module")
def pack_worker(workers, tmp_path_factory):
    if LEGACY:
        pytest.skip("the legacy actor packs its kept rows in update_policy (test_verl_trim)")
    return engine_runs.EngineWorker(h.model_dir(str(tmp_path_factory.mktemp("verl_pack"))), mbs=PACK_MBS)


def packed_shape(n_mini: int) -> tuple[int, int]:
    """(forward/backward calls, rows through them) the packing makes of the ``sparse`` layout's kept rows:
    per mini-batch ceil(K / M) micro-batches of ceil(K / calls) rows."""
    kept = [r for r in range(h.ROWS) if r not in h.ZERO_ROWS["sparse"]]
    mini = h.ROWS // n_mini
    calls = rows = 0
    for m in range(n_mini):
        k = sum(m * mini <= r < (m + 1) * mini for r in kept)
        n = -(-k // PACK_MBS)
        calls, rows = calls + n, rows + n * -(-k // n)
    return calls, rows


@pytest.mark.parametrize("agg", h.AGG_MODES)
@pytest.mark.parametrize("n_mini", [1, 2, 4])
def test_kept_rows_fill_as_few_micro_batches_as_they_need(pack_worker, agg, n_mini, record_property):
    """Static batching: verl's micro-batch size 4, 5 kept rows in 16: 2 calls of 3 rows, not 2 of 4;
    one micro-batch per mini-batch (the benchmark's shape, n_mini=4): 1-2 rows each, not 4."""
    ref = pack_worker.run(None, agg=agg, n_mini=n_mini, zero="sparse")
    got = pack_worker.run(FILTER, agg=agg, n_mini=n_mini, zero="sparse")
    err = h.max_rel(got, ref)
    record_property("exact_filter_packed_grad_rel_ws1", err)
    assert len(ref.grads) == n_mini and err <= TOL, err
    calls, rows = packed_shape(n_mini)
    assert (ref.forwards, ref.grad_rows) == (h.ROWS // PACK_MBS, h.ROWS)
    assert (got.forwards, got.grad_rows) == (calls, rows), (got.forwards, got.grad_rows)
    assert sum(got.metrics["grpo_patches/micro_batches_dropped"]) == ref.forwards - got.forwards
    assert sum(got.metrics["grpo_patches/padding_rows"]) == rows - (h.ROWS - len(h.ZERO_ROWS["sparse"]))
    assert got.status["savings"].get("micro_batches_dropped", 0) == ref.forwards - got.forwards


def test_dynamic_batching_packs_the_kept_rows_by_tokens(workers, record_property):
    """``use_dynamic_bsz``: verl's own token budget packs the kept rows; the calls saved are counted."""
    ref = run(None, workers, agg="token-mean", dynamic=True, n_mini=1, zero="sparse")
    got = run(FILTER, workers, agg="token-mean", dynamic=True, n_mini=1, zero="sparse")
    err = h.max_rel(got, ref)
    record_property("exact_filter_packed_grad_rel_ws1", err)
    assert err <= TOL and got.forwards < ref.forwards and got.grad_rows == h.ROWS - len(h.ZERO_ROWS["sparse"])
    if not LEGACY:
        assert got.metrics["grpo_patches/micro_batches_dropped"] == [ref.forwards - got.forwards]


def test_a_micro_batch_size_in_a_denominator_is_detected(pack_worker, monkeypatch):
    """The packing is exact only because ppo_loss never reads the micro-batch size: a loss that scales
    by it (as a ``1 / gradient-accumulation`` factor would) fails the comparison."""
    from verl.workers.utils import losses

    real = losses.ppo_loss

    def ppo_loss(config, model_output, data, dp_group=None):  # the name the filter recognises verl's loss by
        loss, metrics = real(config, model_output, data, dp_group)
        return loss * data["micro_batch_size_per_gpu"] / PACK_MBS, metrics

    monkeypatch.setattr(losses, "ppo_loss", ppo_loss)
    ref = pack_worker.run(None, agg="token-mean", n_mini=1, zero="sparse")
    got = pack_worker.run(FILTER, agg="token-mean", n_mini=1, zero="sparse")
    assert got.forwards < ref.forwards and h.max_rel(got, ref) > 1e2 * TOL


@pytest.mark.parametrize("dynamic", [False, True])
def test_dropped_rows_metrics_keeps_every_metric(workers, dynamic, record_property):
    ref = run(None, workers, agg="seq-mean-token-mean", dynamic=dynamic, n_mini=2)
    got = run({**FILTER, "dropped_rows_metrics": True}, workers, agg="seq-mean-token-mean", dynamic=dynamic, n_mini=2)
    err = h.max_rel(got, ref)
    record_property("exact_filter_nograd_grad_rel_ws1", err)
    assert err <= TOL and got.grad_rows + got.nograd_rows == h.ROWS  # each row forwarded once
    if LEGACY:
        assert got.grad_rows == KEPT
    else:  # a micro-batch of dropped rows only still runs one of them with autograd (the backward needs a graph)
        assert KEPT <= got.grad_rows < h.ROWS and got.forwards > ref.forwards
    # verl's own micro-batches, each forwarded twice: no call saved, and never a negative saving
    assert set(np.ravel(got.metrics["grpo_patches/micro_batches_dropped"])) == {0}
    assert "micro_batches_dropped" not in got.status["savings"]
    verls = {k: v for k, v in got.metrics.items() if not k.startswith("grpo_patches/")}
    assert set(verls) == set(ref.metrics)
    for name, value in ref.metrics.items():
        if name == "mfu" or name.startswith("perf/"):  # the engine's timing / memory readings
            continue
        assert torch.allclose(torch.tensor(verls[name], dtype=torch.float64), torch.tensor(value, dtype=torch.float64),
                              rtol=1e-5, atol=1e-6), name


@pytest.mark.parametrize("setting,value,named", [
    ("entropy_coeff", 0.01, "actor.entropy_coeff == 0"),
    ("kl_loss_coef", 0.1, "actor.kl_loss_coef == 0"),
    ("loss_mode", "kl_cov", "loss_mode='kl_cov' is not row-local"),
])
def test_settings_that_give_zero_rows_a_gradient(workers, setting, value, named):
    """True: one clear error naming the setting; "auto": verl's own update, the reason in status()."""
    kw = {"agg": "token-mean", setting: value}
    if setting == "kl_loss_coef":
        kw.update(use_kl_loss=True, batch_extra={"ref_log_prob": h.make_batch()["old_log_probs"] - 0.1})
    with pytest.raises(IncompatibleOptionsError, match=named) as info:
        run(FILTER, workers, **kw)
    message = str(info.value)  # refuse_or_note's wording: the option, the reason, the fix
    assert message.startswith("zero_advantage_filter=True: ")
    assert "zero_advantage_filter=False to grpo_patches.enable('verl', ...)" in message
    ref = run(None, workers, **kw)
    got = run({"zero_advantage_filter": "auto", "logprob_skip": False}, workers, **kw)
    assert h.max_rel(got, ref) <= TOL and got.grad_rows == ref.grad_rows == h.ROWS
    notes = [n for by_class in got.status["by_class"].values() for n in by_class.values()]
    assert any(n.startswith("off: ") and named.split(" ")[0] in n for n in notes), got.status["by_class"]


# --- two data-parallel ranks (FSDP2 over gloo) ----------------------------------------------

WS2 = [("token-mean", False, 2, "interleaved"), ("seq-mean-token-mean", True, 1, "grouped"),
       ("seq-mean-token-sum-norm", False, 1, "grouped"), ("seq-mean-token-sum", True, 2, "interleaved")]


def _ws2_worker(rank: int, port: int, out_dir: str, model_dir: str) -> None:
    torch.set_num_threads(1)
    if LEGACY:
        h.init_pg(rank, 2, port)
    else:
        engine_runs.engine_setup(rank, 2, port)
    workers = None if LEGACY else {d: engine_runs.EngineWorker(model_dir, dynamic=d) for d in (False, True)}
    results = []
    for agg, dynamic, n_mini, zero in WS2:
        kw = dict(agg=agg, dynamic=dynamic, n_mini=n_mini, zero=zero, rank=rank, world=2)
        if LEGACY:
            kw["shard"] = True
        ref = run(None, workers, **kw)
        # rank 1 keeps 4 rows, rank 0 all its 8: the filter pads rank 1 to the same count
        got = run(FILTER, workers, **kw)
        results.append({"config": [agg, dynamic, n_mini, zero], "err": h.max_rel(got, ref), "steps": len(got.grads),
                        "forwards": got.forwards, "ref_forwards": ref.forwards, "grad_rows": got.grad_rows})
        if (agg, dynamic) == ("token-mean", False):  # dropped_rows_metrics=True: two forwards per micro-batch
            nograd = run({**FILTER, "dropped_rows_metrics": True}, workers, **kw)
            results[-1]["nograd_err"] = h.max_rel(nograd, ref)
            results[-1]["nograd_forwards"] = nograd.forwards
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ws2_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl_ws2")
    model_dir = h.model_dir(str(out)) if not LEGACY else ""
    mp.spawn(_ws2_worker, args=(h.free_port(), str(out), model_dir), nprocs=2, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_two_ranks_exact_with_identical_work(ws2_results, record_property):
    rank0, rank1 = ws2_results
    for a, b in zip(rank0, rank1):
        assert a["err"] <= TOL and b["err"] <= TOL, (a, b)
        assert a["steps"] == b["steps"] and a["forwards"] == b["forwards"], (a, b)  # FSDP collectives line up
        assert a["forwards"] <= a["ref_forwards"] and a["grad_rows"] < h.ROWS * (2 if a["config"][2] == 2 else 1)
        assert a.get("nograd_err", 0.0) <= TOL and b.get("nograd_err", 0.0) <= TOL, (a, b)
        assert a.get("nograd_forwards") == b.get("nograd_forwards"), (a, b)
    record_property("exact_filter_grad_rel_ws2", max(r["err"] for r in rank0 + rank1))
    assert any("nograd_err" in r for r in rank0)
    record_property("exact_filter_nograd_grad_rel_ws2", max(r.get("nograd_err", 0.0) for r in rank0 + rank1))
