"""What a newcomer reads from ``grpo-patches``: plain help text, the version, the demo's defaults,
and status in words when the patches wait for a module to be imported."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from importlib import metadata

import pytest

import grpo_patches
from grpo_patches.cli import format_status, main
from grpo_patches.demo import DEFAULT_STEPS
from tests.helpers.fakefw_site import make_site


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_help_is_plain_text(capsys):
    text = _help(capsys)
    assert "`" not in text  # reStructuredText markup belongs in docstrings, not in --help
    for command in ("status", "demo", "env", "run", "--version"):
        assert command in text


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"grpo-patches {grpo_patches.__version__}"
    assert metadata.version("grpo-patches") == grpo_patches.__version__  # pyproject reads it from the package


def test_the_console_script_prints_the_version():
    script = os.path.join(os.path.dirname(sys.executable), "grpo-patches")
    if not os.path.exists(script):
        pytest.skip("the grpo-patches console script is not installed next to this interpreter")
    out = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"grpo-patches {grpo_patches.__version__}"


def test_demo_help_shows_every_default(capsys):
    text = " ".join(_help(capsys, "demo").split())
    assert f"optimizer steps per run (default: {DEFAULT_STEPS})" in text
    assert "--no-progress" in text and "no progress bars" in text


WAITING = """
import json, grpo_patches
grpo_patches.enable('fakefw')
import fakefw  # the package alone: its patched modules are not imported yet
before = grpo_patches.status()['fakefw']
import fakefw.worker
middle = grpo_patches.status()['fakefw']
from grpo_patches.cli import format_status
print(json.dumps({'before': before, 'middle': middle, 'table': format_status({'fakefw': before})}))
"""


def test_status_says_in_words_which_import_applies_the_patches(tmp_path):
    site = make_site(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_PATCHES")}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(WAITING)], capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(site)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.splitlines()[-1])
    before, middle = out["before"], out["middle"]
    assert (before["patched"], before["pending_import"]) == (False, True)
    assert before["waiting_for"] == ["fakefw.trainer", "fakefw.worker"]
    assert before["summary"] == ("enabled, not patched yet: the fakefw patches apply when fakefw.trainer and "
                                 "fakefw.worker are imported")
    assert middle["waiting_for"] == ["fakefw.trainer"]
    assert middle["summary"] == ("patched in fakefw.worker; the patches of fakefw.trainer apply when it is imported")
    assert "\nfakefw:\n" in out["table"] and " ".join(before["summary"].split()) in " ".join(out["table"].split())
    assert re.search(r"fakefw .* on import \(below\)", out["table"])


def test_status_after_import_trl_names_the_trainer_module():
    """The issue's case: ``import trl`` imports no trainer module, so nothing is patched yet."""
    pytest.importorskip("trl")
    code = ("import grpo_patches, trl; grpo_patches.enable('trl'); from grpo_patches.cli import format_status; "
            "print(format_status(grpo_patches.status()))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_PATCHES")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "the trl patches apply when trl.trainer.grpo_trainer" in proc.stdout


def test_a_patched_framework_reads_patched():
    report = {"x": {"installed": "1.0", "supported_range": ">=1", "supported": True, "reason": "", "patched": True,
                    "pending_import": False, "waiting_for": [], "summary": "patched (x.trainer)",
                    "options": {}, "notes": {}, "savings": {}}}
    table = format_status(report)
    assert re.search(r"^x\s+1\.0\s+>=1\s+yes$", table, re.M) and "on import" not in table
    assert "Nothing is patched" not in table


def test_status_fits_100_columns_with_one_line_per_patch_and_a_hint_when_nothing_is_patched():
    report = {"trl": {"installed": "1.16.0", "supported_range": ">=0.20,<1.17", "supported_versions": "0.20 – 1.16",
                      "supported": True, "reason": "", "patched": True, "pending_import": False,
                      "summary": "patched (trl.trainer.grpo_trainer)",
                      "options": {**grpo_patches.Options().as_dict(), "tiled_loss": "auto", "verify_every": 1},
                      "patches": [{"target": "m:GRPOTrainer.compute_loss", "option": "tiled_loss",
                                   "state": "off (tiled_loss=False)"},
                                  {"target": "m:GRPOTrainer.compute_loss", "option": "verify_every",
                                   "state": "off (verify_every=None)"},
                                  {"target": "m:GRPOTrainer._compute_loss", "option": None, "state": "applied"}],
                      "notes": {"tiled_loss": "off: " + "a long reason " * 20}, "savings": {"rows_dropped": 3}}}
    table = format_status(report)
    assert max(map(len, table.splitlines())) <= 100, table
    assert table.count("GRPOTrainer.compute_loss") == 1
    assert "GRPOTrainer.compute_loss: off (tiled_loss=False; verify_every=None)" in table
    assert "options: tiled_loss=auto, verify_every=1; the others at their defaults" in table
    assert re.search(r"^trl\s+1\.16\.0\s+0\.20 – 1\.16\s+yes$", table, re.M)
    idle = format_status({"trl": {**report["trl"], "patched": False, "options": None, "patches": [], "notes": {},
                                  "savings": {}, "summary": None}})
    assert "Nothing is patched in this process" in idle and "GRPO_PATCHES=trl grpo-patches status" in idle
