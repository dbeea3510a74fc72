"""A framework's entry point run as a user runs it, in a subprocess (the end-to-end tests of every framework).

:func:`launched` puts ``grpo-patches run --frameworks <name> --options ...`` in front of a command (the
README's way to patch every process of a run); :func:`run_logged` runs it with a timeout and keeps
its output (also in ``output.log`` of its folder).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def other_package() -> list[str]:
    """``GRPO_E2E_PYTHONPATH``: folders holding another copy of grpo_patches (e.g. one with a planted fault),
    to go first on a patched run's ``PYTHONPATH``; ``grpo-patches run`` builds the start-up directory from it."""
    return [p for p in os.environ.get("GRPO_E2E_PYTHONPATH", "").split(os.pathsep) if p]


def launched(framework: str, options: str, startup: Path, command: list[str]) -> list[str]:
    """``command`` through ``grpo-patches run`` (the console script next to this interpreter, else the module)."""
    cli = Path(sys.executable).parent / "grpo-patches"
    launcher = [str(cli)] if cli.exists() else [sys.executable, "-m", "grpo_patches.cli"]
    return [*launcher, "run", "--frameworks", framework, "--options", options, "--dir", str(startup), "--", *command]


def run_logged(command: list[str], folder: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run ``command`` in ``folder``: its exit status (-1: timed out) and output, written to ``folder/output.log``."""
    try:
        proc = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)
        returncode, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        returncode, output = -1, f"timed out after {timeout} s\n{_text(exc.stdout)}{_text(exc.stderr)}"
    (folder / "output.log").write_text(output)
    return returncode, output


def _text(value: object) -> str:
    """TimeoutExpired's output: bytes even under ``text=True`` (CPython's behaviour), or None."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value or "")
