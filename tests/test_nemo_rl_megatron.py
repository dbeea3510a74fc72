"""NeMo-RL's Megatron policy worker: the zero-advantage filter does not cover it yet, and says so.

On each tag's stand-in (:mod:`tests.helpers.nemo_fake`), ``grpo.setup`` with ``policy.megatron_cfg.enabled``:
``"auto"`` notes it in ``status()``, ``True`` raises before training, a DTensor policy gets no note.
"""

from __future__ import annotations

import importlib

import pytest

import grpo_patches
from grpo_patches.errors import IncompatibleOptionsError
from tests.helpers import nemo_fake
from tests.helpers.nemo_fixtures import fake_nemo  # noqa: F401  (fixture)


def _setup(tag: str, megatron: bool):
    grpo = importlib.import_module("nemo_rl.algorithms.grpo")
    tiny = importlib.import_module("nemo_rl.models.tiny").TinyLM
    config = nemo_fake.master_config(tag, policy={"model_factory": tiny, "megatron_cfg": {"enabled": megatron}})
    return grpo.setup(config, None, None, None)


@pytest.mark.parametrize("tag", nemo_fake.TAGS)
def test_auto_notes_and_true_refuses(fake_nemo, tag):  # noqa: F811
    fake_nemo(tag)
    grpo_patches.enable("nemo_rl", zero_advantage_filter="auto")
    _setup(tag, megatron=False)
    assert "Megatron" not in str(grpo_patches.status()["nemo_rl"]["notes"].get("zero_advantage_filter"))
    _setup(tag, megatron=True)
    note = grpo_patches.status()["nemo_rl"]["notes"]["zero_advantage_filter"]
    assert note.startswith("off: NeMo-RL's Megatron policy worker"), note
    grpo_patches.disable("nemo_rl")
    grpo_patches.enable("nemo_rl", zero_advantage_filter=True)
    with pytest.raises(IncompatibleOptionsError, match="Megatron policy worker"):
        _setup(tag, megatron=True)
