"""NeMo-RL's Megatron policy worker: the zero-advantage filter does not cover it yet, and says so.

On each tag's stand-in (:mod:`tests.nemo_fake`) a ``megatron_policy_worker`` module is added with
the real class names (v0.5.0 ``MegatronPolicyWorker``, v0.6.0+ ``MegatronPolicyWorkerImpl``) and
``train``'s signature: ``"auto"`` leaves every row in and notes why in ``status()``, ``True``
raises before training, evaluation calls and other losses pass through.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import grpo_patches
from grpo_patches.errors import IncompatibleOptionsError
from tests import nemo_fake
from tests.nemo_fixtures import fake_nemo  # noqa: F401  (fixture)

WORKER = '''
class {impl}:
    def train(self, data, loss_fn, eval_mode=False, gbs=None, mbs=None, timer=None):
        return {{"rows": len(data["advantages"])}}
'''


def _megatron_worker(root: str, tag: str):
    impl = "MegatronPolicyWorker" if tag == "v0.5.0" else "MegatronPolicyWorkerImpl"
    path = Path(root) / "nemo_rl" / "models" / "policy" / "workers" / "megatron_policy_worker.py"
    path.write_text(WORKER.format(impl=impl))
    importlib.invalidate_caches()
    return getattr(importlib.import_module("nemo_rl.models.policy.workers.megatron_policy_worker"), impl)()


def _loss(tag: str):
    module = "nemo_rl.algorithms.loss_functions" if tag == "v0.5.0" else "nemo_rl.algorithms.loss.loss_functions"
    return importlib.import_module(module).ClippedPGLossFn


@pytest.mark.parametrize("tag", nemo_fake.TAGS)
def test_auto_notes_and_true_refuses(fake_nemo, tag):  # noqa: F811
    source = fake_nemo(tag)
    grpo_patches.enable("nemo_rl", zero_advantage_filter="auto")
    worker = _megatron_worker(source.root, tag)
    loss = object.__new__(_loss(tag))
    data = {"advantages": [0.0, 1.0]}
    assert worker.train(data, loss) == {"rows": 2}
    notes = [n for by_class in grpo_patches.status()["nemo_rl"]["by_class"].values() for n in by_class.values()]
    assert any(n.startswith("off: NeMo-RL's Megatron policy worker") for n in notes), notes
    grpo_patches.disable("nemo_rl")
    grpo_patches.enable("nemo_rl", zero_advantage_filter=True)
    assert worker.train(data, loss, eval_mode=True) == {"rows": 2}  # nothing to filter
    with pytest.raises(IncompatibleOptionsError, match="Megatron policy worker"):
        worker.train(data, loss)
