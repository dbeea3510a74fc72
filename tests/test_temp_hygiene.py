"""Tests, the kit and the demo leave nothing in the system's temp folder: what they write goes to
per-process folders removed when the process ends (``grpo_patches_testing.scratch``, the demo's
tiny-model folder), or to pytest's own ``tmp_path``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

MAKES_FOLDERS = """
import json, os
from grpo_patches.demo import tiny_model
from grpo_patches_testing import scratch
made = [tiny_model.tiny_model_path(), scratch.directory("trl_run_")]
assert all(os.path.isdir(p) for p in made)
print(json.dumps(made))
"""


def test_the_default_folders_are_gone_when_the_process_ends():
    proc = subprocess.run([sys.executable, "-c", MAKES_FOLDERS], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if not k.startswith("GRPO_PATCHES")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    made = json.loads(proc.stdout.splitlines()[-1])
    assert made and not any(os.path.exists(p) for p in made), made


def test_the_kit_writes_only_under_its_scratch_root():
    """No ``mkdtemp`` / ``TemporaryDirectory`` of the kit or the tests' helpers outside ``scratch``
    (a Ray session folder that its runner removes itself is the exception)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    allowed = {"scratch.py", "verl_main_ppo.py", "nemo_rl_run_grpo.py"}  # the last two: rmtree in their stop()
    offenders = [str(p.relative_to(root)) for folder in ("tests/grpo-patches-testing", "tests/helpers")
                 for p in (root / folder).rglob("*.py")
                 if p.name not in allowed and "mkdtemp(" in p.read_text()]
    assert offenders == []
