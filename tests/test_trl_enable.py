"""TRL adapter: declared targets, exact restore, enable-before-import and ``GRPO_PATCHES=trl``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

from packaging.version import Version  # noqa: E402

import grpo_patches  # noqa: E402
from grpo_patches import registry  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

#: A 1-step run (GA=3, spg=2): rollouts at micro-steps 0 and 2; TRL recomputes both, neither
#: needs it (the second is consumed only by the last micro-step: training ends there).
SCRIPT = """
import json, sys
import grpo_patches
from tests.trl_harness import train
before = grpo_patches.status()["trl"]
trl_imported_before = "trl" in sys.modules
result = train(None, steps=1)
import trl.trainer.grpo_trainer as g
print("RESULT " + json.dumps({
    "trl_imported_before": trl_imported_before,
    "pending_before": before["pending_import"],
    "wrapped": type(vars(g.GRPOTrainer)["_generate_and_score_completions"]).__name__,
    "savings": result.savings,
    "patched": grpo_patches.status()["trl"]["patched"],
    "options": grpo_patches.status()["trl"]["options"],
}))
"""


def run_python(code: str, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_PATCHES")}
    environ.update(HF_HUB_OFFLINE="1", GRPO_PATCHES_DISABLE_PLUGIN_AUTOLOAD="1", **env)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_the_patch_table_narrows_the_supported_range_and_never_collides():
    from packaging.specifiers import SpecifierSet

    adapter = registry.get("trl")
    supported = SpecifierSet(adapter.supported)
    for version in ("0.20.0", "0.24.0", "1.6.0", "1.7.0", "1.16.0"):
        assert Version(version) in supported
        names = [t.name for t in adapter.targets(Version(version))]
        assert "trl.trainer.grpo_trainer:GRPOTrainer.training_step" in names
        assert "trl.trainer.grpo_trainer:GRPOTrainer._generate_and_score_completions" in names
        assert len(names) == len(set(names)), "two records on one attribute for one version"
    for record in adapter.patches:  # a record's own range only narrows the adapter's
        assert record.versions is None or record.versions.startswith((">=", "<"))
        assert callable(record.load_wrapper())  # every wrapper named in the table exists


def test_disable_restores_the_original_methods():
    import trl.trainer.grpo_trainer as g

    names = ("training_step", "_generate_and_score_completions")
    before = {n: g.GRPOTrainer.__dict__.get(n) for n in names}
    inherited = {n: n not in g.GRPOTrainer.__dict__ for n in names}
    grpo_patches.enable("trl")
    try:
        for n in names:
            assert g.GRPOTrainer.__dict__[n] is not before[n]
        grpo_patches.enable("trl")  # idempotent
    finally:
        grpo_patches.disable("trl")
    for n in names:
        assert g.GRPOTrainer.__dict__.get(n) is before[n]
        assert (n not in g.GRPOTrainer.__dict__) == inherited[n]


@pytest.mark.slow
def test_env_variable_patches_a_fresh_interpreter_at_import():
    """One interpreter proves both: the start-up .pth enables TRL before it is imported (the
    record is pending), the patch lands at import, and the options variable arrives."""
    out = run_python(SCRIPT, GRPO_PATCHES="trl", GRPO_PATCHES_OPTIONS="zero_advantage_filter=0")
    assert out["trl_imported_before"] is False and out["pending_before"] is True
    assert out["wrapped"] == "FunctionWrapper" and out["patched"] is True
    assert out["savings"]["old_logprob_passes_skipped"] == 2
    assert out["options"]["zero_advantage_filter"] is False
