"""CI leaves the checkout as it found it: its compat report goes to an ignored folder, the
committed ``compat/RESULTS.md`` / ``results.json`` are only rewritten by a developer's
``bash scripts/run compat``, and ``.ci/run`` fails when anything git tracks changed."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "compat"))
import report  # noqa: E402

CI = (ROOT / ".ci" / "run").read_text()


def _fake_session_records(folder: Path) -> None:
    folder.mkdir()
    (folder / "cpu-trl-0.20.0.json").write_text(json.dumps(
        {"framework": "trl", "version": "0.20.0", "tier": "cpu", "status": "ran", "date": "2099-01-01",
         "installed": {"trl": "0.20.0"}}))
    (folder / "cpu-ray-startup.json").write_text(json.dumps(
        {"session": "ray-startup", "framework": "ray-startup", "version": "ray 9.9", "tier": "cpu", "status": "ran",
         "date": "2099-01-01", "installed": {"ray": "9.9"}}))
    for name in ("cpu-trl-0.20.0", "cpu-ray-startup"):
        (folder / f"{name}.xml").write_text(
            '<testsuites><testsuite name="pytest"><testcase classname="tests.test_x" name="test_ok"/>'
            "</testsuite></testsuites>")


def test_the_report_writes_where_it_is_told_and_leaves_the_committed_files(tmp_path, monkeypatch):
    committed = {p: p.read_bytes() for p in (report.MD_OUT, report.JSON_OUT) if p.exists()}
    monkeypatch.setattr(report, "RESULTS_DIR", tmp_path / "records")
    _fake_session_records(tmp_path / "records")
    assert report.main(["--out", str(tmp_path / "report")]) == 0
    assert {p: p.read_bytes() for p in committed} == committed  # byte for byte
    table = (tmp_path / "report" / "RESULTS.md").read_text()
    assert "| trl | 0.20.0 | cpu | pass | 1 | 0 | 0 | - | trl 0.20.0 | 2099-01-01 |" in table
    assert "| ray-startup | ray 9.9 | cpu | pass | 1 | 0 | 0 | - | ray 9.9 | 2099-01-01 |" in table
    assert json.loads((tmp_path / "report" / "results.json").read_text())["cpu-ray-startup"]["passed"] == 1


def test_a_session_keeps_one_row_across_version_bumps(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS_DIR", tmp_path / "records")
    _fake_session_records(tmp_path / "records")
    previous = {"cpu-ray-startup": {"session": "ray-startup", "framework": "ray-startup", "version": "ray 1.0",
                                    "tier": "cpu", "status": "ran", "passed": 1, "failed": 0, "skipped": 0}}
    results = report.collect(previous)
    assert results["cpu-ray-startup"]["version"] == "ray 9.9"
    assert report.render(results).count("| ray-startup |") == 1


def test_the_committed_results_have_the_ray_startup_row():
    assert re.search(r"^\| ray-startup \| ray [\d.]+ \| cpu \| pass \|", report.MD_OUT.read_text(), re.M)


def _ci_report_dir() -> str:
    match = re.search(r"COMPAT_REPORT_DIR=(\S+) bash scripts/run compat ci", CI)
    assert match, "CI must run the compat cells with their report sent to an ignored folder"
    return shlex.split(match.group(1))[0]


def test_ci_sends_the_compat_report_to_an_ignored_folder():
    folder = _ci_report_dir()
    assert not folder.startswith(("/", "..")), folder  # inside the checkout
    listed = subprocess.run(["git", "check-ignore", "-q", f"{folder}/RESULTS.md"], cwd=ROOT)
    if listed.returncode == 128:
        pytest.skip("not a git checkout")
    assert listed.returncode == 0, f"{folder} is not ignored by git"
    run = (ROOT / "scripts" / "run").read_text()
    assert 'compat/report.py ${COMPAT_REPORT_DIR:+--out "$COMPAT_REPORT_DIR"}' in run


def test_ci_fails_when_it_changed_the_checkout():
    """The last thing .ci/run does: compare git's view of the checkout with the one it started from."""
    lines = [line.strip() for line in CI.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert "checkout_state() { git status --porcelain; git diff HEAD | sha256sum; }" in lines
    first_step = next(i for i, line in enumerate(lines) if line.startswith("bash scripts/run"))
    assert any("before=$(checkout_state)" in line for line in lines[:first_step])
    compare = next(i for i, line in enumerate(lines) if line.startswith('if [ "$before" != "$after" ]'))
    assert compare > max(i for i, line in enumerate(lines) if line.startswith(("bash scripts/run", "COMPAT_REPORT_DIR")))
    assert "exit 1" in lines[compare:compare + 5]
