"""The old-logprob pass in real verl's v0 trainer (option ``logprob_skip``), patches off vs on:
skipped exactly when verl's actor would not read it (one mini-batch, one epoch, nothing else
reading it), through the real ``RayPPOTrainer._compute_old_log_prob`` then the actor's update:

* 0.7.x legacy actor: it ignores old log-probs on-policy; the update's gradient equals verl's
  with the real old log-probs, and ``actor/entropy`` equals what the trainer computes from the
  real pass;
* engine line (0.8+): the loss uses the detached current log-probs; a placeholder reaching the
  loss, or an update that does not confirm the substitution, stops the run.

The reference pass: ``test_verl_reference_pass_skip.py``; verl 0.9's V1 trainer: ``..._v1.py``.
"""

from __future__ import annotations

import pytest

from grpo_patches_testing import verl_actor_runs as h

from grpo_patches_testing import verl_engine_runs as engine_runs
from tests.helpers.verl_fixtures import process_group  # noqa: F401  (autouse: one process group per module)

if h.VERL is None:
    pytest.skip("verl is not installed (the compat cells install it)", allow_module_level=True)

import torch  # noqa: E402
from packaging.version import Version  # noqa: E402

from grpo_patches_testing import verl_minimal_pass as m  # noqa: E402

LEGACY = h.line().startswith("legacy")
V = Version(h.VERL)
SKIP = engine_runs.LOGPROB_SKIP


# --- the 0.7.x legacy worker ------------------------------------------------------------------

OLD_SKIP = Version("0.7") <= V < Version("0.8")


@pytest.mark.skipif(not OLD_SKIP, reason="0.7's legacy actor ignores old log-probs on-policy; 0.8+ always reads them")
def test_on_policy_update_skips_the_old_logprob_pass(record_property):
    ref = engine_runs.old_pass_then_update(None, legacy=True)
    got = engine_runs.old_pass_then_update(SKIP, legacy=True)
    err = h.max_rel(got, ref)
    record_property("exact_old_logprob_skip_grad_rel", err)
    assert err == 0.0 and ref.forwards == 1 and got.forwards == 0  # the pass ran once, then never
    # the trainer's entropy came from a placeholder: the actor logs the real one, from the same weights
    assert got.metrics["trainer/actor/entropy"] != got.metrics["trainer/actor/entropy"]  # NaN placeholder
    assert got.metrics["actor/entropy"] == pytest.approx(ref.metrics["trainer/actor/entropy"], rel=1e-6)
    assert got.status["savings"]["old_logprob_passes_skipped"] == 1


@pytest.mark.skipif(not OLD_SKIP, reason="0.7.x legacy worker only")
@pytest.mark.parametrize("config", [{"mini": 8}, {"epochs": 2}, {"use_kl_in_reward": True}])
def test_the_pass_runs_when_something_reads_it(config):
    mini = config.pop("mini", 16)
    got = engine_runs.old_pass_then_update(SKIP, mini=mini, legacy=True, **config) if "epochs" not in config else None
    if got is None:  # 2 epochs: the trainer-side decision alone
        from verl import DataProto

        trainer = engine_runs.v0_trainer(m.legacy_group(h.Run(), epochs=2), legacy=True, epochs=2)
        h.patches(SKIP)
        try:
            trainer._compute_old_log_prob(DataProto.from_dict(tensors=h.make_batch(), meta_info={"temperature": 1.0}))
            notes = h.verl_status()["by_class"]
        finally:
            h.patches(None)
        assert trainer.actor_rollout_wg.calls == 1
        assert any("computed" in n for c in notes.values() for n in c.values())
        return
    assert got.forwards == 1 and "old_logprob_passes_skipped" not in got.status["savings"]


# --- the engine line (0.8+: the loss uses the detached current log-probs) ---------------------

ENGINE_OLD_SKIP = V >= Version("0.8")


@pytest.mark.skipif(not ENGINE_OLD_SKIP, reason="engine line (0.8+)")
def test_engine_on_policy_update_skips_the_old_logprob_pass(record_property):
    ref = engine_runs.old_pass_then_update(None)
    got = engine_runs.old_pass_then_update(SKIP)
    err = h.max_rel(got, ref)
    record_property("exact_old_logprob_skip_grad_rel", err)
    assert err <= 1e-6 and ref.forwards == 1 and got.forwards == 0, (err, ref.forwards, got.forwards)
    trainer_entropy = got.metrics["trainer/actor/entropy"]
    assert trainer_entropy != trainer_entropy  # NaN: the trainer's value came from the placeholder
    got_mfu = got.metrics["trainer/perf/mfu/actor_infer"]
    assert got_mfu != got_mfu  # no pass ran: NaN, not a 0
    (entropy,) = got.metrics["actor/entropy"]  # from the update's own forward, the trainer's aggregation
    assert entropy == pytest.approx(ref.metrics["trainer/actor/entropy"], rel=1e-6)
    assert "actor/entropy_loss" not in got.metrics  # verl logs it only when the config asks for entropies
    for name in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert torch.allclose(torch.tensor(got.metrics[name], dtype=torch.float64),
                              torch.tensor(ref.metrics[name], dtype=torch.float64), rtol=1e-5, atol=1e-6), name
    assert got.status["savings"]["old_logprob_passes_skipped"] == 1


@pytest.mark.skipif(not ENGINE_OLD_SKIP, reason="engine line (0.8+)")
@pytest.mark.parametrize("config", [{"mini": 8}, {"use_kl_in_reward": True}])
def test_engine_pass_runs_when_something_reads_it(config):
    got = engine_runs.old_pass_then_update(SKIP, **config)
    assert got.forwards == 1 and "old_logprob_passes_skipped" not in got.status["savings"]
    assert "actor/entropy" not in got.metrics  # the trainer's pass gives it


@pytest.mark.skipif(not ENGINE_OLD_SKIP, reason="engine line (0.8+)")
def test_engine_refuses_a_skip_on_an_update_that_is_not_on_policy():
    from grpo_patches.adapters.verl.placeholders import PlaceholderError

    with pytest.raises(PlaceholderError, match="not on-policy"):
        engine_runs.old_pass_then_update(SKIP, mini=8, placeholder=True)  # two mini-batches, yet a skipped pass


@pytest.mark.skipif(not ENGINE_OLD_SKIP, reason="engine line (0.8+)")
def test_a_placeholder_reaching_the_loss_stops_the_run():
    """Whatever the options (here: logprob_skip=False, so no substitution), verl's policy loss
    refuses placeholder old log-probs. verl alone logs a NaN loss and steps the optimizer with a
    zero gradient (its grad norm is 0, finite: no warning) — an update that silently does nothing."""
    from grpo_patches.adapters.verl import placeholders

    td = engine_runs.engine_batch(extra={"old_log_probs": placeholders.like(h.make_batch()["response_mask"])})
    with pytest.raises(placeholders.PlaceholderError, match="logprob_skip=False"):
        engine_runs.shared_worker().run_td(td, {"logprob_skip": False, "zero_advantage_filter": False})
    td = engine_runs.engine_batch(extra={"old_log_probs": placeholders.like(h.make_batch()["response_mask"])})
    run = engine_runs.shared_worker().run_td(td, None)  # verl alone
    (loss,), (grad_norm,) = run.metrics["actor/pg_loss"], run.metrics["grad_norm"]
    assert loss != loss and grad_norm == 0.0 and not run.grads[0].any()


@pytest.mark.skipif(V < Version("0.7"), reason="0.6 has no old-logprob skip")
def test_the_trainer_runs_the_pass_when_its_workers_do_not_substitute(monkeypatch):
    from grpo_patches.adapters.verl import skip_guarantee

    monkeypatch.setattr(skip_guarantee, "worker_ready", lambda: "logprob_skip is off in the worker (pid 1)")
    got = engine_runs.old_pass_then_update(SKIP, legacy=LEGACY)
    assert got.forwards == 1
    if not LEGACY:
        assert "old_logprob_passes_skipped" not in got.status["savings"]
    notes = [n for c in got.status["by_class"].values() for n in c.values()]
    assert any("logprob_skip is off in the worker" in n for n in notes), notes


@pytest.mark.skipif(V < Version("0.7"), reason="0.6 has no old-logprob skip")
def test_a_worker_substitutes_only_with_logprob_skip_and_its_records_applied():
    from grpo_patches.adapters.verl.skip_guarantee import worker_ready

    engine_runs.import_worker_modules()
    h.patches(None)
    assert "not enabled in the worker" in worker_ready()
    h.patches({"logprob_skip": False})
    try:
        assert "logprob_skip is off in the worker" in worker_ready()
    finally:
        h.patches(None)
    h.patches(SKIP)
    try:
        assert worker_ready() is None
    finally:
        h.patches(None)


@pytest.mark.skipif(V < Version("0.7"), reason="0.6 has no old-logprob skip")
def test_an_update_that_does_not_confirm_the_substitution_stops_the_run():
    from types import SimpleNamespace

    from grpo_patches.adapters.verl import old_logprobs, placeholders, skip_guarantee

    class Trainer:
        pass

    trainer = Trainer()

    def update(metrics):  # RayPPOTrainer._update_actor returns a DataProto with the metrics in meta_info
        return lambda batch: SimpleNamespace(meta_info={"metrics": metrics})

    h.patches(SKIP)
    try:
        old_logprobs.update_actor(update({}), trainer, (None,), {})  # no skip pending: nothing to confirm
        skip_guarantee.expect_substitution(trainer)
        with pytest.raises(placeholders.PlaceholderError, match="did not report substituting"):
            old_logprobs.update_actor(update({"actor/pg_loss": [0.1]}), trainer, (None,), {})
        skip_guarantee.expect_substitution(trainer)
        old_logprobs.update_actor(update({"actor/grpo_patches/old_log_probs_substituted": [1.0]}), trainer,
                                  (None,), {})
    finally:
        h.patches(None)
