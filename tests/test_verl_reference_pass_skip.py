"""The reference pass in real verl (option ``logprob_skip``), patches off vs on: at KL coefficient 0
``need_reference_policy`` says no (no reference model); the actor runs without ``ref_log_prob`` and
its gradient equals verl's with the real reference log-probs; metrics computed from the placeholder
are not logged. The old-logprob pass: ``test_verl_old_logprob_skip.py`` (v0 trainer), ``..._v1.py``.
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

import grpo_patches  # noqa: E402

LEGACY = h.line().startswith("legacy")
V = Version(h.VERL)
SKIP = engine_runs.LOGPROB_SKIP


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
    return engine_runs.shared_worker().run(options, batch_extra=batch_extra, **config)



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
