"""TRL adapter: declared targets, exact restore, enable-before-import and ``GRPO_PATCHES=trl``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

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


def test_targets_are_declared_for_the_supported_range():
    from packaging.version import Version

    adapter = registry.get("trl")
    names = [t.name for t in adapter.targets(Version("1.16.0"))]
    assert "trl.trainer.grpo_trainer:GRPOTrainer.training_step" in names
    assert "trl.trainer.grpo_trainer:GRPOTrainer._generate_and_score_completions" in names
    assert len(names) == len(set(names)), "two records on one attribute would overwrite each other"
    ours = [t for t in adapter.targets(Version("1.16.0")) if t.name.split(".")[-1] in
            ("training_step", "_generate_and_score_completions")]
    assert len(ours) == 2 and all(t.versions == ">=0.20,<1.17" for t in ours)


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
def test_enable_before_import_patches_at_import():
    out = run_python("import grpo_patches; grpo_patches.enable('trl')\n" + SCRIPT)
    assert out["trl_imported_before"] is False and out["pending_before"] is True
    assert out["wrapped"] == "FunctionWrapper" and out["patched"] is True
    assert out["savings"]["old_logprob_passes_skipped"] == 2


@pytest.mark.slow
def test_env_variable_patches_a_fresh_interpreter():
    out = run_python(SCRIPT, GRPO_PATCHES="trl")
    assert out["wrapped"] == "FunctionWrapper" and out["patched"] is True
    assert out["savings"]["old_logprob_passes_skipped"] == 2
    off = run_python(SCRIPT, GRPO_PATCHES="trl", GRPO_PATCHES_OPTIONS="recompute=0")
    assert "old_logprob_passes_skipped" not in off["savings"]
