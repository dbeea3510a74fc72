"""The old-logprob pass on verl 0.9's V1 (TransferQueue) trainer (option ``logprob_skip``), patches
off vs on: ``PPOTrainer._compute_old_log_prob`` (the real method, an in-memory store for
TransferQueue) writes a placeholder instead of running the pass exactly when the update is on-policy,
and the update of a batch carried through the trainer's stages has the gradient of verl's own pass.
The v0 trainer: ``test_verl_old_logprob_skip.py``.
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

V = Version(h.VERL)
SKIP = engine_runs.LOGPROB_SKIP


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
    from grpo_patches.adapters.verl import placeholders

    engine_runs.import_worker_modules()
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
    assert old.shape == mask.shape and placeholders.fills(old)  # NaN, never readable as log-probs
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

    engine_runs.import_worker_modules()
    ref = engine_runs.old_pass_then_update(None)  # verl: the real pass, then the update
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
