"""The README's main job: ``grpo-patches demo`` trains twice and prints the comparison table."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("trl")


def test_demo_prints_fewer_passes_and_identical_weights():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("GRPO_PATCHES", None)
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_patches.cli", "demo", "--steps", "4", "--no-progress"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not re.search(r"\d+%\|", proc.stdout + proc.stderr), proc.stderr[-2000:]  # --no-progress: no bar at all
    assert "Loading weights" not in proc.stderr  # transformers' own bars included
    out = proc.stdout
    off, on = map(int, re.search(r"old-logprob passes \(rows\)\s+(\d+) \(\d+\)\s+(\d+)", out).groups())
    assert on < off  # GA=3 / steps_per_generation=2: upstream recomputes every rollout
    grad_rows = re.search(r"policy-forward rows, with autograd\s+(\d+)\s+(\d+)", out).groups()
    assert int(grad_rows[1]) < int(grad_rows[0])  # dropped rows get no forward (counted beneath the patches)
    for row in ("trainer-side time", "generation \\+ rewards", "backward"):  # time is shown, never asserted
        assert re.search(row + r".*\s+\d+\.\d\s+\d+\.\d", out), row
    dropped = re.search(r"rows dropped from the update\s+(\d+)\s+(\d+)", out).groups()
    assert dropped[0] == "0" and int(dropped[1]) > 0
    assert float(re.search(r"max \|weight difference\|\s+(\S+)", out).group(1)) == 0.0
    # what it proves comes first: the same result, the work saved, the time (the runs took turns)
    summary = out[:out.index("old-logprob passes (rows)")]
    assert "Same result:  the final weights after 4 optimizer steps are bitwise identical." in summary
    assert re.search(r"Less work:\s+old-logprob passes (\d+) -> (\d+)", summary)
    assert re.search(r"Less time:\s+trainer side \d+\.\d+x .* took turns step by step", summary)
