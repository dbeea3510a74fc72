"""Verify mode on verl: each optimizer step of a verify step checked against verl's own update
(fp32, SGD), in-process, on the line the cell installs (engine 0.8+: ``TrainingWorker``;
legacy 0.6.1-0.7.x: ``DataParallelPPOActor.update_policy``); two data-parallel ranks at the end.

* correct code: the checks pass, their figures land in verl's metrics and ``status()``, and the
  run is bitwise the run without verification (gradients, weights, random state);
* a faulty ``grpo_filter_zero_advantage`` plugin (drops a row with a non-zero advantage):
  ``"raise"`` stops before the first optimizer step; ``"disable"`` finishes on weights equal to
  unpatched verl's and switches the filter off;
* a skipped old-logprob pass: compared with the log-probs the loss used; dropout left on makes
  them differ (caught), and ``"disable"`` then trains on verl's own pass and tells the trainer;
* the skipped reference pass: the loss with and without the KL term at coefficient 0;
* the tiled loss on verl's fused forward;
* two ranks (FSDP2 over gloo) make the same checks and agree.
"""

from __future__ import annotations

import json
import os

import pytest

from grpo_patches_testing import verl_actor_runs as h

from grpo_patches_testing import verl_engine_runs as engine_runs

if h.VERL is None:
    pytest.skip("verl is not installed (the compat cells install it)", allow_module_level=True)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import grpo_patches  # noqa: E402
from grpo_patches.errors import GrpoPatchesWarning, IncompatibleOptionsError  # noqa: E402
from tests.helpers.faulty_plugins import DropsANonZeroRow, past_the_contract  # noqa: E402
from tests.helpers.verl_fixtures import fresh_verify_records, process_group  # noqa: E402,F401  (autouse)

FILTER = {"zero_advantage_filter": True, "logprob_skip": False}
SKIP = {"zero_advantage_filter": False, "logprob_skip": True}
GRAD = "grpo_patches/verify/grad_rel_diff"
OLD = "grpo_patches/verify/old_logprob_max_abs_diff"
REF = "grpo_patches/verify/reference_loss_abs_diff"
LEGACY = h.line().startswith("legacy")
engine_only = pytest.mark.skipif(LEGACY, reason="the engine line's checks (verl 0.8+)")
legacy_only = pytest.mark.skipif(not LEGACY, reason="the legacy actor's checks (verl 0.6.1-0.7.x)")


@pytest.fixture(autouse=True)
def _verify_mode_is_the_line_under_test():
    """The planted filter faults break the hook's contract: let them past it (tests/helpers/faulty_plugins.py)."""
    with past_the_contract():
        yield


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    if LEGACY:
        return None
    return engine_runs.EngineWorker(h.model_dir(str(tmp_path_factory.mktemp("verl_verify"))))


def weights(worker) -> dict:
    return {k: h.full(v).detach().clone() for k, v in worker.engine.module.state_dict().items()}


def same_weights(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def planted(plugin):
    grpo_patches.plugin_manager().register(plugin)
    return plugin


@engine_only
def test_verify_passes_leaves_no_trace_and_logs_its_figures(worker, record_property):
    torch.manual_seed(5)  # both runs start from the same random state (the worker resets only its weights)
    ref = worker.run(FILTER, n_mini=2)
    ref_weights, ref_rng = weights(worker), torch.get_rng_state()
    torch.manual_seed(5)
    got = worker.run({**FILTER, "verify_every": 1}, n_mini=2)
    assert [torch.equal(a, b) for a, b in zip(got.grads, ref.grads)] == [True, True]  # bitwise: no trace
    assert same_weights(weights(worker), ref_weights) and torch.equal(torch.get_rng_state(), ref_rng)
    figures = got.metrics[GRAD]
    assert len(figures) == 2 and max(figures) <= 1e-5, figures  # one per mini-batch (optimizer step)
    assert got.metrics["actor/pg_loss"] == ref.metrics["actor/pg_loss"]
    verified = got.status["verify"]
    assert verified["steps_verified"] == 2 and not verified["failures"]
    record_property("exact_verify_grad_rel_diff", max(figures))


@engine_only
def test_verify_every_n_checks_step_0_and_every_nth(worker):
    got = worker.run({**FILTER, "verify_every": 2}, n_mini=2, epochs=2)  # optimizer steps 0..3
    assert len(got.grads) == 4 and len(got.metrics[GRAD]) == 2
    assert got.status["verify"]["steps_verified"] == 2


@engine_only
def test_a_faulty_filter_plugin_raises_before_the_first_step(worker):
    plugin = planted(DropsANonZeroRow())
    try:
        with pytest.raises(grpo_patches.ExactnessError) as err:
            worker.run({**FILTER, "verify_every": 1}, n_mini=2)
    finally:
        grpo_patches.plugin_manager().unregister(plugin)
    assert plugin.calls >= 1 and err.value.step == 0 and err.value.quantity == "grad_rel_diff"
    assert "zero_advantage_filter" in err.value.optimizations and err.value.measured > 1e-3


@engine_only
def test_a_faulty_filter_plugin_with_disable_finishes_as_unpatched(worker):
    ref = worker.run(None, n_mini=2)
    ref_weights = weights(worker)
    plugin = planted(DropsANonZeroRow())
    try:
        with pytest.warns(GrpoPatchesWarning, match="zero_advantage_filter"):
            got = worker.run({**FILTER, "verify_every": 1, "verify_action": "disable"}, n_mini=2)
    finally:
        grpo_patches.plugin_manager().unregister(plugin)
    assert h.max_rel(got, ref) == 0.0 and same_weights(weights(worker), ref_weights)
    assert plugin.calls == 1  # step 0 found it; step 1 ran verl's own update (the filter is off)
    assert got.metrics[GRAD][0] > 1e-3 and "zero_advantage_filter" in got.status["switched_off"]
    assert got.metrics["grpo_patches/verify/switched_off/zero_advantage_filter"] == [1.0]


@engine_only
def test_the_tiled_loss_is_verified(tmp_path_factory, record_property):
    path = h.model_dir(str(tmp_path_factory.mktemp("verl_verify_fused")), fused=True)
    # verl 0.8.0's own fused forward needs remove-padding (padded log-probs fail its ppo_loss, unpatched too)
    fused = engine_runs.EngineWorker(path, fused=True, remove_padding=h.VERL.startswith("0.8"))
    options = {"tiled_loss": True, "zero_advantage_filter": True, "logprob_skip": False}
    ref = fused.run(options, n_mini=2)
    got = fused.run({**options, "verify_every": 1}, n_mini=2)
    assert [torch.equal(a, b) for a, b in zip(got.grads, ref.grads)] == [True, True]
    assert max(got.metrics[GRAD]) <= 1e-5 and got.status["savings"]["tiled_loss_micro_batches"] > 0
    record_property("exact_verify_tiled_grad_rel_diff", max(got.metrics[GRAD]))


@engine_only
def test_the_skipped_old_logprob_pass_is_compared_with_what_the_loss_used(record_property):
    ref = engine_runs.old_pass_then_update(SKIP)
    got = engine_runs.old_pass_then_update({**SKIP, "verify_every": 1})
    assert got.forwards == ref.forwards == 0  # the trainer still skips it; the worker runs it for the check
    assert torch.equal(got.grads[0], ref.grads[0])
    assert got.metrics[OLD][0] <= 1e-5 and got.metrics[GRAD][0] <= 1e-5, got.metrics
    record_property("exact_verify_old_logprob_max_abs_diff", got.metrics[OLD][0])


@pytest.fixture(scope="module")
def dropout_worker(tmp_path_factory):
    if LEGACY:
        return None
    return engine_runs.EngineWorker(h.model_dir(str(tmp_path_factory.mktemp("verl_verify_dropout"))), dropout=0.3)


@engine_only
def test_dropout_left_on_is_caught(dropout_worker):
    with pytest.raises(grpo_patches.ExactnessError) as err:
        engine_runs.old_pass_then_update({**SKIP, "verify_every": 1}, worker=dropout_worker)
    assert err.value.quantity == "old_logprob_max_abs_diff" and err.value.optimizations == ("logprob_skip",)
    assert dropout_worker.current is None


@engine_only
def test_dropout_with_disable_trains_on_verls_pass_and_tells_the_trainer(dropout_worker):
    torch.manual_seed(3)
    ref = engine_runs.old_pass_then_update(None, worker=dropout_worker)
    torch.manual_seed(3)
    with pytest.warns(GrpoPatchesWarning, match="logprob_skip"):
        got = engine_runs.old_pass_then_update({**SKIP, "verify_every": 1, "verify_action": "disable"},
                                            worker=dropout_worker)
    # verl's own update on its own pass (this pass batches differently from the trainer's: rounding only)
    assert h.max_rel(got, ref) <= 1e-6
    assert got.metrics["grpo_patches/verify/switched_off/logprob_skip"] == [1.0]
    assert got.metrics[OLD][0] > 1e-3


def test_the_trainer_adopts_a_switch_off_and_runs_the_pass_again():
    from grpo_patches.adapters.verl.old_logprobs import update_actor

    class Output:
        meta_info = {"metrics": {"actor/grpo_patches/verify/switched_off/logprob_skip": 1.0}}

    class Trainer:
        pass

    h.patches({**SKIP, "verify_every": 1})
    try:
        assert grpo_patches.api.active_options("verl").logprob_skip
        update_actor(lambda *a: Output(), Trainer(), (None,), {})
        assert not grpo_patches.api.active_options("verl").logprob_skip
        assert "logprob_skip" in grpo_patches.status()["verl"]["switched_off"]
        from grpo_patches.adapters.verl.old_logprobs import compute_old_log_prob

        assert compute_old_log_prob(lambda *a: "verl's pass", Trainer(), (None,), {}) == "verl's pass"
    finally:
        h.patches(None)


@engine_only
def test_the_skipped_reference_pass_is_checked(worker):
    got = worker.run({**SKIP, "verify_every": 1}, use_kl_loss=True, kl_loss_coef=0.0)
    assert got.metrics[REF] == [0.0] and got.metrics[GRAD][0] == 0.0, got.metrics  # x + 0 * kl == x: bitwise
    assert "kl_loss" not in got.metrics  # the patched metrics: no KL term was computed


@engine_only
def test_verify_is_refused_on_the_megatron_engine():
    from grpo_patches.adapters.verl import verify_megatron

    class Megatron:
        pass

    from functools import partial

    from verl.workers.utils.losses import ppo_loss

    loss = partial(ppo_loss, config=object())
    h.patches({**FILTER, "verify_every": 1})
    try:
        with pytest.raises(IncompatibleOptionsError, match="Megatron"):
            verify_megatron.forward_backward_batch(lambda data, loss_function, forward_only=False: None, Megatron(),
                                                   ({}, loss, False), {})
    finally:
        h.patches(None)


# --- the legacy actor (0.6.1-0.7.x) -------------------------------------------------------


@legacy_only
def test_legacy_verify_passes_leaves_no_trace_and_logs_its_figures(record_property):
    torch.manual_seed(5)
    ref = h.legacy_run(FILTER, n_mini=2)
    ref_rng = torch.get_rng_state()
    torch.manual_seed(5)
    got = h.legacy_run({**FILTER, "verify_every": 1}, n_mini=2)
    assert len(got.grads) == 4  # the harness records verl's two steps, then the patched two
    assert [torch.equal(a, b) for a, b in zip(got.grads[2:], ref.grads)] == [True, True]
    assert same_weights(got.weights, ref.weights) and torch.equal(torch.get_rng_state(), ref_rng)
    assert len(got.metrics[GRAD]) == 2 and max(got.metrics[GRAD]) <= 1e-5, got.metrics[GRAD]
    assert got.status["verify"]["steps_verified"] == 2 and not got.status["verify"]["failures"]
    record_property("exact_verify_legacy_grad_rel_diff", max(got.metrics[GRAD]))


@legacy_only
def test_legacy_faulty_filter_plugin_raise_and_disable():
    ref = h.legacy_run(None, n_mini=2)
    plugin = planted(DropsANonZeroRow())
    try:
        with pytest.raises(grpo_patches.ExactnessError) as err:
            h.legacy_run({**FILTER, "verify_every": 1}, n_mini=2)
        assert err.value.step == 0 and "zero_advantage_filter" in err.value.optimizations
        with pytest.warns(GrpoPatchesWarning, match="zero_advantage_filter"):
            got = h.legacy_run({**FILTER, "verify_every": 1, "verify_action": "disable"}, n_mini=2)
    finally:
        grpo_patches.plugin_manager().unregister(plugin)
    assert same_weights(got.weights, ref.weights)  # verl's own update, bitwise
    assert got.metrics["actor/pg_loss"] == ref.metrics["actor/pg_loss"]
    assert got.metrics["grpo_patches/verify/switched_off/zero_advantage_filter"] == [1.0]
    assert "zero_advantage_filter" in got.status["switched_off"]


@legacy_only
def test_legacy_skipped_passes_are_verified():
    from grpo_patches.adapters.verl.version import installed

    ref_skip = h.legacy_run({**SKIP, "verify_every": 1}, use_kl_loss=True, kl_loss_coef=0.0)
    assert ref_skip.metrics[GRAD] == [0.0]  # the KL term at coefficient 0, with and without: bitwise
    if installed() >= __import__("packaging.version").version.Version("0.7"):
        from grpo_patches.adapters.verl import placeholders

        mask = h.make_batch()["response_mask"]
        got = h.legacy_run({**SKIP, "verify_every": 1}, batch_extra={"old_log_probs": placeholders.like(mask)})
        assert got.metrics[GRAD] == [0.0] and got.metrics["grpo_patches/old_log_probs_substituted"] == 1.0


# --- two data-parallel ranks ---------------------------------------------------------------


def _ws2_worker(rank: int, port: int, out_dir: str, model_dir: str) -> None:
    import warnings

    torch.set_num_threads(1)
    kw = dict(n_mini=2, rank=rank, world=2)
    if LEGACY:
        h.init_pg(rank, 2, port)
        kw["shard"] = True
        run = h.legacy_run
    else:
        engine_runs.engine_setup(rank, 2, port)
        run = engine_runs.EngineWorker(model_dir).run
    result = {}
    ok = run({**FILTER, "verify_every": 1}, **kw)
    result["figures"] = ok.metrics[GRAD]
    ref = run(None, **kw)
    plugin = planted(DropsANonZeroRow())
    try:
        with warnings.catch_warnings(), past_the_contract():  # a spawned rank: the fixture's lift is not here
            warnings.simplefilter("ignore")
            got = run({**FILTER, "verify_every": 1, "verify_action": "disable"}, **kw)
    finally:
        grpo_patches.plugin_manager().unregister(plugin)
    mine = got.grads[-2:] if not LEGACY else got.grads[2:]  # legacy: verl's steps recorded first, then ours
    result.update(disabled=max(h.rel(a, b) for a, b in zip(mine, ref.grads)) if mine else None,
                  switched_off=sorted(got.status["switched_off"]), faulty=got.metrics[GRAD], steps=len(got.grads),
                  same_weights=same_weights(got.weights, ref.weights) if LEGACY else None)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()


def test_two_ranks_make_the_same_checks_and_agree(tmp_path_factory, record_property):
    out = tmp_path_factory.mktemp("verl_verify_ws2")
    mp.spawn(_ws2_worker, args=(h.free_port(), str(out), h.model_dir(str(out))), nprocs=2, join=True)
    rank0, rank1 = (json.loads((out / f"rank{r}.json").read_text()) for r in range(2))
    figures = rank0["figures"]
    if not LEGACY:  # the engine gathers each rank's metrics: step 0 of both ranks, then step 1
        assert figures[0::2] == figures[1::2]
        figures = figures[0::2]
        assert rank0 == rank1  # the same figures (agreed by one all-reduce each), the same verdicts
    else:  # each rank returns its own metrics: the agreed figures
        assert rank0["figures"] == rank1["figures"] and rank0["faulty"] == rank1["faulty"]
        assert rank0["switched_off"] == rank1["switched_off"]
    assert len(figures) == 2 and max(figures) <= 1e-5
    assert rank0["faulty"][0] > 1e-3 and rank0["switched_off"] == ["zero_advantage_filter"]
    if LEGACY:  # the patched update stopped at its first step; the actor was left as verl's update left it
        assert rank0["steps"] == 3 and rank0["same_weights"] and rank1["same_weights"]
    else:  # each rank's gradient: unpatched verl's
        assert rank0["disabled"] == 0.0 and rank0["steps"] == 2
    record_property("exact_verify_grad_rel_diff_ws2", max(rank0["figures"]))
