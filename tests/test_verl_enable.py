"""``enable("verl")`` on the installed verl: the line's records apply, status says so, disable restores.

Imports the modules a verl driver, TaskRunner and worker import (for the installed line) and
checks that every record of that line is applied where its module is imported, that records
of the other line are absent, and that ``disable`` puts every original back.
"""

from __future__ import annotations

import importlib

import pytest

from tests import verl_harness as h

if h.VERL is None:
    pytest.skip("verl is not installed (the compat cells install it)", allow_module_level=True)

import grpo_patches  # noqa: E402
from grpo_patches.adapters.verl import ADAPTER  # noqa: E402
from packaging.version import Version  # noqa: E402


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:  # a trainer entry point needing hydra etc.: its records stay pending
        return False
    return True


def test_every_record_of_the_installed_line_applies_and_disable_restores():
    version = Version(h.VERL)
    targets = ADAPTER.targets(version)
    assert targets and all(t.applies_to(version) for t in targets)
    imported = {t.module for t in targets if _importable(t.module)}
    assert {"verl.workers.actor.dp_actor", "verl.workers.engine.fsdp.transformer_impl"} & imported
    originals = {}
    for t in targets:
        if t.module in imported:
            owner = importlib.import_module(t.module)
            *path, name = t.attribute.split(".")
            for part in path:
                owner = getattr(owner, part)
            originals[t.name] = (owner, name, owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name))
    grpo_patches.enable("verl", zero_advantage_filter=True)
    try:
        status = grpo_patches.status()["verl"]
        assert status["supported"] and status["patched"] and status["installed"] == h.VERL
        states = {p["target"]: p["state"] for p in status["patches"]}
        for t in targets:
            assert states[t.name] == ("applied" if t.module in imported else "pending import"), t.name
        other_line = [t.name for t in ADAPTER.patches if not t.applies_to(version)]
        assert not set(other_line) & set(status.get("targets", []))
    finally:
        grpo_patches.disable("verl")
    for name, (owner, attr, original) in originals.items():
        now = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        assert now is original, name


def test_unknown_option_values_are_clear_errors():
    from grpo_patches.errors import OptionError

    with pytest.raises(OptionError, match="zero_advantage_filter"):
        grpo_patches.enable("verl", zero_advantage_filter="yes")
