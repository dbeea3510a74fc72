"""Every command and pointer in the repository works from a fresh clone: no committed file names a
path of one machine (an absolute path under a machine's own folders, a venv folder outside the
checkout, notes beside the repository)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: An absolute path under a machine's own folders (not after a word, a dot, a scheme's colon or a
#: slash: URLs and relative paths pass), a venvs folder, notes kept beside the repository.
MACHINE_PATH = re.compile(r"(?<![\w.:/-])/(?:work|home|root|Users|opt|mnt|scratch|srv|data|tmp)/"
                          r"|(?<![\w.-])venvs/|\.\./shared\b|shared/notes\b")
#: Not text, or text whose job is to hold such paths (this test's own examples).
SKIP = {"LICENSE", "tests/test_no_machine_paths.py"}


def committed_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: cannot tell which files are committed")
    return [name for name in listed.stdout.splitlines() if name not in SKIP and (ROOT / name).is_file()]


def machine_paths(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if MACHINE_PATH.search(line)]


def test_the_pattern_finds_machine_paths_and_only_them():
    found = ["python /work/venvs/x/bin/python", "see ../shared/notes/frameworks.md", "/tmp/benchenv/bin/pip",
             "NEMO=~/venvs/nemo/bin/python", "/home/me/RL", "HOME=/root/.cache"]
    passing = ["#!/usr/bin/env bash", "https://github.com/a/b/tmp/x", "compat/.nox/cpu-verl-0-7-1/bin/python",
               "~/.cache/grpo_patches/", ".cache/benchenv/bin/pip", "../constraints.txt", "tests/helpers/x.py"]
    assert [bool(machine_paths(line)) for line in found] == [True] * len(found)
    assert [bool(machine_paths(line)) for line in passing] == [False] * len(passing)


def test_no_committed_file_names_a_path_of_one_machine():
    offending = {}
    for name in committed_files():
        try:
            text = (ROOT / name).read_text()
        except UnicodeDecodeError:
            continue  # binary
        lines = machine_paths(text)
        if lines:
            offending[name] = lines
    assert offending == {}, "run every command from a fresh clone, or say how to make what it needs"
