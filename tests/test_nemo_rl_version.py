"""The NeMo-RL adapter reads the version from the source and every patch record resolves on every tag."""

from __future__ import annotations

import importlib

import pytest

import grpo_patches
from grpo_patches import registry
from grpo_patches.errors import UnsupportedFrameworkError
from tests.helpers import nemo_fake


@pytest.mark.parametrize("tag", nemo_fake.TAGS)
def test_version_is_read_from_the_source(fake_nemo, tag):
    fake_nemo(tag)
    entry = grpo_patches.status()["nemo_rl"]
    assert entry["installed"] == nemo_fake.READS_AS[tag]
    assert entry["supported"], entry["reason"]
    assert "package_info.py says" in entry["version_origin"]
    assert ("raised to 0.8.0.dev0" in entry["version_origin"]) == (tag == "main")


def test_not_importable_means_not_installed():
    assert registry.get("nemo_rl").installed_version() is None
    with pytest.raises(UnsupportedFrameworkError, match="nemo_rl is not installed"):
        grpo_patches.enable("nemo_rl")


@pytest.mark.parametrize("tag", nemo_fake.TAGS)
def test_every_record_of_the_tag_resolves_and_is_applied(fake_nemo, tag):
    fake_nemo(tag)
    options = {"zero_advantage_filter": True, "tiled_loss": tag != "v0.5.0", "verify_every": 1 if tag != "v0.5.0" else None}
    grpo_patches.enable("nemo_rl", **options)
    adapter = registry.get("nemo_rl")
    version = adapter.installed_version()
    for module in dict.fromkeys(t.module for t in adapter.targets(version)):
        importlib.import_module(module)
    states = {r["target"]: r["state"] for r in grpo_patches.status()["nemo_rl"]["patches"]}
    assert states and set(states.values()) == {"applied"}, states
    grpo_patches.disable("nemo_rl")
    from nemo_rl.algorithms import grpo

    assert not hasattr(grpo.grpo_train, "__wrapped__")


def test_tiled_loss_needs_v060(fake_nemo):
    fake_nemo("v0.5.0")
    with pytest.raises(UnsupportedFrameworkError, match=r"tiled_loss needs nemo_rl >=0.6.0"):
        grpo_patches.enable("nemo_rl", tiled_loss=True)
    grpo_patches.enable("nemo_rl", tiled_loss="auto")
    assert grpo_patches.status()["nemo_rl"]["notes"]["tiled_loss"].startswith("off: tiled_loss needs nemo_rl >=0.6.0")


def test_the_real_source_tests_leave_torch_alone_without_a_source():
    """The main suite collects tests/compat_nemo_rl too: without a NeMo-RL source they must skip
    before installing their CPU shim, or every later test (TRL's) runs on a patched torch."""
    import sys

    import torch

    from grpo_patches_testing import nemo_rl_cpu

    zeros = torch.zeros
    sys.modules.pop("tests.compat_nemo_rl.test_real_loss", None)
    with pytest.raises(pytest.skip.Exception, match="no NeMo-RL source"):
        importlib.import_module("tests.compat_nemo_rl.test_real_loss")
    assert not nemo_rl_cpu.CPU_SHIM.active and torch.zeros is zeros
