"""Log-prob passes in real verl (option ``logprob_skip``): patches off vs on.

* reference pass at KL coefficient 0: ``need_reference_policy`` says no (no reference model);
  the actor runs without ``ref_log_prob`` and its gradient equals verl's with the real
  reference log-probs; metrics computed from the placeholder are not logged.
* old-logprob pass (0.7.x legacy): skipped exactly when verl's actor ignores it (one
  mini-batch, one epoch); the update's gradient equals verl's with the real old log-probs,
  and ``actor/entropy`` equals what the trainer computes from the real pass.
"""

from __future__ import annotations

import pytest

from grpo_patches.testing import verl_actor_runs as h

from grpo_patches.testing import verl_engine_runs as engine_runs
from tests.helpers.verl_fixtures import process_group  # noqa: F401  (autouse: one process group per module)

if h.VERL is None:
    pytest.skip("verl is not installed (the compat cells install it)", allow_module_level=True)

import torch  # noqa: E402
from packaging.version import Version  # noqa: E402

import grpo_patches  # noqa: E402

LINE = h.line()
LEGACY = LINE.startswith("legacy")
V = Version(h.VERL)
SKIP = {"zero_advantage_filter": False, "logprob_skip": True, "recompute": False}  # the minimal pass: test_verl_minimal_pass


@pytest.mark.skipif(V < Version("0.7"), reason="0.6 decides the reference model from a role mapping")
def test_no_reference_model_when_no_coefficient_can_be_non_zero():
    from verl.trainer.ppo import ray_trainer, utils

    cases = [
        (h.trainer_config(), False),
        (h.trainer_config(kl_loss_coef=0.1), True),
        (h.trainer_config(use_kl_loss=False, use_kl_in_reward=True), False),
        (h.trainer_config(use_kl_loss=False, use_kl_in_reward=True, kl_coef=0.001), True),
        (h.trainer_config(use_kl_loss=False, use_kl_in_reward=True, kl_ctrl="adaptive"), True),  # it can change
        (h.trainer_config(use_kl_loss=False), False),
    ]
    for config, needed in cases:
        assert utils.need_reference_policy(config) is (config.actor_rollout_ref.actor.use_kl_loss
                                                       or config.algorithm.use_kl_in_reward)  # verl's own rule
    h.patches(SKIP)
    try:
        for config, needed in cases:
            for module in (utils, ray_trainer):  # every binding answers the same
                assert bool(module.need_reference_policy(config)) is needed, (config, module)
        notes = grpo_patches.status()["verl"]["notes"]
        assert "reference_pass" in notes
    finally:
        h.patches(None)


@pytest.mark.skipif(V >= Version("0.7"), reason="0.7+ decides from the config (test above)")
def test_no_reference_role_when_no_coefficient_can_be_non_zero_06():
    from verl.trainer.main_ppo import TaskRunner
    from verl.trainer.ppo.utils import Role, need_reference_policy

    class RefWorker:  # never instantiated: only its role's presence matters
        pass

    def roles(config):
        runner = TaskRunner()
        runner.add_ref_policy_worker(config, RefWorker)
        return need_reference_policy(runner.role_worker_mapping), Role.RefPolicy in runner.mapping

    cases = [(h.trainer_config(), False), (h.trainer_config(kl_loss_coef=0.1), True),
             (h.trainer_config(use_kl_loss=False, use_kl_in_reward=True, kl_ctrl="adaptive"), True),
             (h.trainer_config(use_kl_loss=False), False)]
    assert [roles(c) for c, _ in cases] == [(True, True)] * 3 + [(False, False)]  # verl's own rule
    h.patches(SKIP)
    try:
        assert [roles(c) for c, _ in cases] == [(n, n) for _, n in cases]
        assert "reference_pass" in grpo_patches.status()["verl"]["notes"]
    finally:
        h.patches(None)


def _ref_batch():
    return {"ref_log_prob": h.make_batch()["old_log_probs"] - 0.2}


def _run(options, batch_extra=None, **config):
    if LEGACY:
        return h.legacy_run(options, batch_extra=batch_extra, **config)
    return _worker().run(options, batch_extra=batch_extra, **config)


_WORKERS: dict = {}


def _worker():
    if "w" not in _WORKERS:
        import tempfile

        _WORKERS["w"] = engine_runs.EngineWorker(h.model_dir(tempfile.mkdtemp()))
    return _WORKERS["w"]


def test_actor_runs_without_reference_log_probs_at_kl_coefficient_zero(record_property):
    kw = dict(agg="token-mean", n_mini=2, use_kl_loss=True, kl_loss_coef=0.0)
    ref = _run(None, batch_extra=_ref_batch(), **kw)  # verl with the real reference pass
    with pytest.raises((KeyError, AssertionError, RuntimeError)):
        _run(None, **kw)  # verl itself needs the key: the placeholder is what makes the skip work
    got = _run(SKIP, **kw)
    err = h.max_rel(got, ref)
    record_property("exact_reference_skip_grad_rel", err)
    assert err == 0.0  # 0 * finite: bitwise identical
    kl_names = {"actor/kl_loss", "actor/kl_coef", "kl_loss", "kl_coef"}
    assert kl_names & set(ref.metrics) and not kl_names & set(got.metrics)
    assert got.status["savings"].get("reference_passes_skipped", 0) >= 1


def test_a_real_kl_coefficient_is_never_touched():
    kw = dict(agg="token-mean", n_mini=1, use_kl_loss=True, kl_loss_coef=0.1)
    ref = _run(None, batch_extra=_ref_batch(), **kw)
    got = _run(SKIP, batch_extra=_ref_batch(), **kw)
    assert h.max_rel(got, ref) == 0.0 and set(got.metrics) >= {k for k in ref.metrics}


def test_in_reward_kl_at_a_fixed_zero_coefficient():
    from verl import DataProto
    from verl.trainer.ppo import core_algos, ray_trainer

    b = h.make_batch()
    b["token_level_scores"] = torch.randn(b["response_mask"].shape)
    ctrl = core_algos.FixedKLController(kl_coef=0.0)
    data = DataProto.from_dict(tensors={**b, "ref_log_prob": b["old_log_probs"] - 0.3})
    want, want_metrics = ray_trainer.apply_kl_penalty(data, ctrl, "kl")
    h.patches(SKIP)
    try:
        got, got_metrics = ray_trainer.apply_kl_penalty(DataProto.from_dict(tensors=b), ctrl, "kl")
    finally:
        h.patches(None)
    assert torch.equal(got.batch["token_level_rewards"], want.batch["token_level_rewards"])
    assert "actor/reward_kl_penalty" in want_metrics and "actor/reward_kl_penalty" not in got_metrics
    assert "ref_log_prob" not in got.batch.keys()


# --- the old-logprob pass (0.7.x legacy worker) ---------------------------------------------

OLD_SKIP = Version("0.7") <= V < Version("0.8")


class _WorkerGroup:
    """Stands in for the actor worker group: runs the real actor's compute_log_prob, counted."""

    world_size = 1

    def __init__(self, actor):
        self.actor, self.calls = actor, 0

    def compute_log_prob(self, data):
        from verl import DataProto

        self.calls += 1
        data.meta_info.update(micro_batch_size=4, max_token_len=40, use_dynamic_bsz=False, temperature=1.0)
        out = self.actor.compute_log_prob(data, calculate_entropy=True)
        log_probs, entropys = (out["log_probs"], out["entropys"]) if isinstance(out, dict) else out
        return DataProto.from_dict(tensors={"old_log_probs": log_probs, "entropys": entropys})


def _trainer(actor, **config):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = object.__new__(RayPPOTrainer)  # no Ray: only the method under test runs
    trainer.config = h.trainer_config(use_kl_loss=False, **config)
    trainer.use_legacy_worker_impl = "auto"
    trainer.actor_rollout_wg = _WorkerGroup(actor)
    return trainer


def _old_pass_then_update(options, *, mini=16, **config):
    """The trainer's old-logprob pass (through the real method), then the actor's update."""
    from verl import DataProto
    from verl.trainer.ppo.core_algos import agg_loss

    h.patches(options)
    run = h.Run()
    model = h.tiny_model(0)
    h.count_forwards(model, run)
    actor = h.legacy_actor(model, mini=mini)
    step = actor._optimizer_step
    actor._optimizer_step = lambda: (run.grads.append(h.grads_of(model.parameters())), step())[1]
    trainer = _trainer(actor, mini=mini, **config)
    batch = h.make_batch()
    batch.pop("old_log_probs")
    data = DataProto.from_dict(tensors=batch, meta_info={"temperature": 1.0})
    try:
        old, _ = trainer._compute_old_log_prob(data)
        entropy = agg_loss(loss_mat=old.batch["entropys"], loss_mask=data.batch["response_mask"],
                           loss_agg_mode="token-mean").item()  # the trainer's actor/entropy
        old.batch.pop("entropys")
        data = data.union(old)
        run.metrics = {"trainer/actor/entropy": entropy, **actor.update_policy(data)}
        run.status = h.verl_status()
    finally:
        h.patches(None)
    run.forwards = trainer.actor_rollout_wg.calls
    return run


@pytest.mark.skipif(not OLD_SKIP, reason="0.7's legacy actor ignores old log-probs on-policy; 0.8+ always reads them")
def test_on_policy_update_skips_the_old_logprob_pass(record_property):
    ref = _old_pass_then_update(None)
    got = _old_pass_then_update(SKIP)
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
    got = _old_pass_then_update(SKIP, mini=mini, **config) if "epochs" not in config else None
    if got is None:  # 2 epochs: the trainer-side decision alone
        from verl import DataProto

        actor = h.legacy_actor(h.tiny_model(0), epochs=2)
        trainer = _trainer(actor, epochs=2)
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


# --- the old-logprob pass on the engine line (0.8+: the loss uses the detached current log-probs) ---

ENGINE_OLD_SKIP = V >= Version("0.8")


@pytest.mark.skipif(not ENGINE_OLD_SKIP, reason="engine line (0.8+)")
def test_engine_on_policy_update_skips_the_old_logprob_pass(record_property):
    ref = engine_runs.engine_old_pass_then_update(None)
    got = engine_runs.engine_old_pass_then_update(SKIP)
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
    got = engine_runs.engine_old_pass_then_update(SKIP, **config)
    assert got.forwards == 1 and "old_logprob_passes_skipped" not in got.status["savings"]
    assert "actor/entropy" not in got.metrics  # the trainer's pass gives it


@pytest.mark.skipif(not ENGINE_OLD_SKIP, reason="engine line (0.8+)")
def test_engine_refuses_a_skip_on_an_update_that_is_not_on_policy():
    from grpo_patches.adapters.verl.placeholder import PlaceholderError

    with pytest.raises(PlaceholderError, match="not on-policy"):
        engine_runs.engine_old_pass_then_update(SKIP, mini=8, placeholder=True)  # two mini-batches, yet a skipped pass


class _FakeTransferQueue:
    """The two TransferQueue calls the v1 trainer's old-logprob step makes, on an in-memory store."""

    def __init__(self, fields):
        self.fields = fields

    def kv_batch_get(self, keys, partition_id, select_fields):
        from tensordict import TensorDict

        return TensorDict({k: self.fields[k] for k in select_fields}, batch_size=[len(keys)])

    def kv_batch_put(self, keys, partition_id, fields):
        from transfer_queue import KVBatchMeta

        self.fields.update(dict(fields.items()))
        return KVBatchMeta(keys=list(keys), partition_id=partition_id, tags=[{} for _ in keys])


def _worker_modules() -> None:
    """Import the modules whose records run in the actor-update process (here: this one)."""
    import importlib

    from grpo_patches.adapters.verl.skip_guarantee import WORKER_MODULES

    for name in WORKER_MODULES:
        if LEGACY == name.endswith("dp_actor"):
            importlib.import_module(name)


class _PassRan(Exception):
    pass


def _v1_trainer(monkeypatch, store, **config):
    """A v1 ``PPOTrainer`` (no Ray, no TransferQueue service: only its methods under test run)."""
    from verl.trainer.ppo.v1 import trainer_base

    monkeypatch.setattr(trainer_base, "tq", store)

    class Group:  # no Ray actors: the actor's update would run in this process
        def compute_log_prob(self, batch):
            raise _PassRan

    concrete = type("Trainer", (trainer_base.PPOTrainer,), {"on_sample_end": lambda self: None,
                                                            "on_step_end": lambda self, *a, **k: None})
    trainer = object.__new__(concrete)
    trainer.config = h.trainer_config(use_kl_loss=False, **config)
    trainer.actor_rollout_wg = Group()
    return trainer


def _kv_batch():
    from transfer_queue import KVBatchMeta

    keys = [f"k{i}" for i in range(h.ROWS)]
    return KVBatchMeta(keys=keys, partition_id="train", tags=[{} for _ in keys], extra_info={})


@pytest.mark.skipif(V < Version("0.9"), reason="the v1 (TransferQueue) trainer is 0.9's")
@pytest.mark.parametrize("config,skipped", [({}, True), ({"mini": 8}, False), ({"use_kl_in_reward": True}, False)])
def test_v1_trainer_skips_the_pass_into_a_placeholder(monkeypatch, config, skipped):
    pytest.importorskip("transfer_queue")
    from grpo_patches.adapters.verl import placeholder

    _worker_modules()
    mask = h.make_batch()["response_mask"]
    store = _FakeTransferQueue({"response_mask": mask})
    trainer = _v1_trainer(monkeypatch, store, **config)
    metrics: dict = {}
    h.patches(SKIP)
    try:
        if not skipped:
            with pytest.raises(_PassRan):
                trainer._compute_old_log_prob(_kv_batch(), metrics)
            return
        trainer._compute_old_log_prob(_kv_batch(), metrics)
    finally:
        h.patches(None)
    old = store.fields["old_log_probs"]
    assert old.shape == mask.shape and placeholder.fills(old)  # NaN, never readable as log-probs
    assert torch.isnan(old).all()
    assert "entropy" not in store.fields and "actor/entropy" not in metrics  # no placeholder metric


@pytest.mark.skipif(V < Version("0.9"), reason="the v1 (TransferQueue) trainer is 0.9's")
def test_v1_skip_holds_when_the_stages_drop_every_marker(monkeypatch, record_property):
    """The 0.9.1 bug: the trainer's skip marker (on ``KVBatchMeta.extra_info``) was lost at the
    next ``kv_batch_put`` and the update trained on zeros. Now the worker keys on what it receives:
    the update of a batch carried through the V1 trainer's stages (fresh metadata at every put)
    has the gradient of verl's own pass."""
    pytest.importorskip("transfer_queue")
    from tensordict import TensorDict

    _worker_modules()
    ref = engine_runs.engine_old_pass_then_update(None)  # verl: the real pass, then the update
    mask = h.make_batch()["response_mask"]
    store = _FakeTransferQueue({"response_mask": mask})
    trainer = _v1_trainer(monkeypatch, store)
    h.patches(SKIP)
    try:
        trainer._compute_old_log_prob(_kv_batch(), {})
        keys = _kv_batch().keys  # _compute_advantage's put: the metadata the update gets is fresh
        fresh = store.kv_batch_put(keys, "train", TensorDict({"advantages": h.make_batch()["advantages"]},
                                                             batch_size=[h.ROWS]))
        assert not fresh.extra_info
        td = engine_runs.engine_batch(extra={"old_log_probs": store.fields["old_log_probs"]})
        got = engine_runs.shared_worker().run_td(td, "as is")
    finally:
        h.patches(None)
    err = h.max_rel(got, ref)
    record_property("exact_v1_old_logprob_skip_grad_rel", err)
    assert err <= 1e-6 and len(got.grads) == 1, err
    assert got.metrics["grpo_patches/old_log_probs_substituted"] == [1.0]


@pytest.mark.skipif(not ENGINE_OLD_SKIP, reason="engine line (0.8+)")
def test_a_placeholder_reaching_the_loss_stops_the_run():
    """Whatever the options (here: logprob_skip=False, so no substitution), verl's policy loss
    refuses placeholder old log-probs. verl alone logs a NaN loss and steps the optimizer with a
    zero gradient (its grad norm is 0, finite: no warning) — an update that silently does nothing."""
    from grpo_patches.adapters.verl import placeholder

    td = engine_runs.engine_batch(extra={"old_log_probs": placeholder.like(h.make_batch()["response_mask"])})
    with pytest.raises(placeholder.PlaceholderError, match="logprob_skip=False"):
        engine_runs.shared_worker().run_td(td, {"logprob_skip": False, "zero_advantage_filter": False})
    td = engine_runs.engine_batch(extra={"old_log_probs": placeholder.like(h.make_batch()["response_mask"])})
    run = engine_runs.shared_worker().run_td(td, None)  # verl alone
    (loss,), (grad_norm,) = run.metrics["actor/pg_loss"], run.metrics["grad_norm"]
    assert loss != loss and grad_norm == 0.0 and not run.grads[0].any()


@pytest.mark.skipif(V < Version("0.7"), reason="0.6 has no old-logprob skip")
def test_the_trainer_runs_the_pass_when_its_workers_do_not_substitute(monkeypatch):
    from grpo_patches.adapters.verl import skip_guarantee

    monkeypatch.setattr(skip_guarantee, "worker_ready", lambda: "logprob_skip is off in the worker (pid 1)")
    if LEGACY:
        got = _old_pass_then_update(SKIP)
        assert got.forwards == 1
    else:
        got = engine_runs.engine_old_pass_then_update(SKIP)
        assert got.forwards == 1 and "old_logprob_passes_skipped" not in got.status["savings"]
    notes = [n for c in got.status["by_class"].values() for n in c.values()]
    assert any("logprob_skip is off in the worker" in n for n in notes), notes


@pytest.mark.skipif(V < Version("0.7"), reason="0.6 has no old-logprob skip")
def test_a_worker_substitutes_only_with_logprob_skip_and_its_records_applied():
    from grpo_patches.adapters.verl.skip_guarantee import worker_ready

    _worker_modules()
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

    from grpo_patches.adapters.verl import placeholder, skip_guarantee

    class Trainer:
        pass

    trainer = Trainer()

    def update(metrics):  # RayPPOTrainer._update_actor returns a DataProto with the metrics in meta_info
        return lambda batch: SimpleNamespace(meta_info={"metrics": metrics})

    h.patches(SKIP)
    try:
        skip_guarantee.update_actor(update({}), trainer, (None,), {})  # no skip pending: nothing to confirm
        skip_guarantee.expect_substitution(trainer)
        with pytest.raises(placeholder.PlaceholderError, match="did not report substituting"):
            skip_guarantee.update_actor(update({"actor/pg_loss": [0.1]}), trainer, (None,), {})
        skip_guarantee.expect_substitution(trainer)
        skip_guarantee.update_actor(update({"actor/grpo_patches/old_log_probs_substituted": [1.0]}), trainer,
                                    (None,), {})
    finally:
        h.patches(None)
