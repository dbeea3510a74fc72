"""``enable("verl")`` on the installed verl: the line's records apply, status says so, disable restores.

Imports the modules a verl driver, TaskRunner and worker import (for the installed line) and
checks that every record of that line is applied where its module is imported, that records
of the other line are absent, and that ``disable`` puts every original back.
"""

from __future__ import annotations

import importlib

import pytest

from grpo_patches_testing import verl_actor_runs as h

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
    # every option verl implements has records for the installed line (none is silently a no-op)
    newer = {"recompute"} if version < Version("0.7") else set()  # the minimal pass starts at 0.7
    assert {t.option for t in targets} >= {t.option for t in ADAPTER.patches} - {None} - newer
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
    grpo_patches.enable("verl", zero_advantage_filter=True, tiled_loss=True, verify_every=1)  # every option on: every record
    try:
        status = grpo_patches.status()["verl"]
        assert status["supported"] and status["patched"] and status["installed"] == h.VERL
        states = {p["target"]: p["state"] for p in status["patches"]}
        for t in targets:
            assert states[t.name] == ("applied" if t.module in imported else "pending import"), t.name
        # records of other versions only (several records stack on one attribute, one name)
        other_line = {t.name for t in ADAPTER.patches if not t.applies_to(version)} - {t.name for t in targets}
        assert not set(other_line) & set(status.get("targets", []))
    finally:
        grpo_patches.disable("verl")
    for name, (owner, attr, original) in originals.items():
        now = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        assert now is original, name


def test_unknown_option_values_are_clear_errors():
    from grpo_patches.errors import OptionError

    with pytest.raises(OptionError, match=r"option 'zero_advantage_filter' must be one of 'auto', True, False; got 'yes'"):
        grpo_patches.enable("verl", zero_advantage_filter="yes")
    assert not grpo_patches.status()["verl"]["patched"]  # nothing was patched for a refused option


@pytest.mark.parametrize("recompute", [True, False])
def test_recompute_is_accepted_and_status_says_what_it_does_in_verl(recompute):
    """One meaning per option: ``recompute`` runs the old-logprob pass only on the rows a loss
    reads after an optimizer step (RayPPOTrainer, verl >= 0.7); ``False`` is verl's own pass."""
    grpo_patches.enable("verl", recompute=recompute)
    try:
        status = grpo_patches.status()["verl"]
        assert status["options"]["recompute"] is recompute
        assert "recompute" not in status["not_applicable"] or Version(h.VERL) < Version("0.7")
        minimal = [r for r in status["patches"] if r["option"] == "recompute" and not r["state"].startswith("off")]
        assert bool(minimal) is (recompute and Version(h.VERL) >= Version("0.7")), minimal
    finally:
        grpo_patches.disable("verl")
