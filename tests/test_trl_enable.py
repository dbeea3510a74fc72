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
from grpo_patches_testing.trl_train import train
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
        targets = adapter.targets(Version(version))
        names = [t.name for t in targets]
        assert "trl.trainer.grpo_trainer:GRPOTrainer.training_step" in names
        assert "trl.trainer.grpo_trainer:GRPOTrainer._generate_and_score_completions" in names
        # records on one attribute stack (the later wraps the earlier): only for different options
        keyed = [(t.name, t.option) for t in targets]
        assert len(keyed) == len(set(keyed)), "two records on one attribute and option for one version"
        stacked = [t.option for t in targets if t.attribute == "GRPOTrainer.compute_loss"]
        assert stacked[-1] == "verify_every", "verify mode must wrap the tiled loss (its patched computation)"
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


def test_trl_warnings_from_a_patched_init_name_the_users_line(monkeypatch, tmp_path):
    """TRL's ``__init__`` warns with ``stacklevel=2``; patched, it must still name this file."""
    import inspect
    import warnings

    from trl import GRPOConfig, GRPOTrainer

    from grpo_patches.demo import tiny_model

    if "rollout_func" not in inspect.signature(GRPOTrainer.__init__).parameters:
        pytest.skip("this TRL has no rollout_func (its experimental-feature warning is the probe)")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "0")
    path = tiny_model.tiny_model_path()
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=4)
    grpo_patches.enable("trl")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = sys._getframe().f_lineno + 1
            GRPOTrainer(model=path, reward_funcs=tiny_model.reward_char_sum, args=args,
                        train_dataset=tiny_model.prompt_dataset(4), processing_class=tiny_model.load_tokenizer(path),
                        rollout_func=lambda prompts, trainer: {})
    finally:
        grpo_patches.disable("trl")
    probes = [w for w in caught if "rollout_func" in str(w.message)]
    assert probes and all((w.filename, w.lineno) == (__file__, line) for w in probes)
