"""A framework's own ``uv.lock`` as pip constraints (open-instruct pins ~360 packages there).

open-instruct is a uv project, not on PyPI: its tested versions are the lock's. A cell with
``lock = "uv.lock"`` installs its packages under these pins, made at build time from the
exported checkout (nothing of the framework is committed here). Left out: packages that do not
come from PyPI (git / url / editable sources) and every name matching ``exclude`` (the GPU stack:
torch, vllm, flash-attn, ``nvidia-*``, which the cell pins or leaves out itself). Where the lock
holds several versions of one package (per platform), the Linux x86_64 one is taken.

    python compat/uv_lock.py LOCK [EXCLUDE ...] > constraints.txt

Imports nothing outside the standard library (nox loads it before any venv exists).
"""

from __future__ import annotations

import fnmatch
import sys
import tomllib
from pathlib import Path

PYPI = "https://pypi.org/simple"
LINUX_X86 = "platform_machine == 'x86_64' and sys_platform == 'linux'"


def pins(lock: Path, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """``{name: version}`` of the lock's PyPI packages, less the names matching ``exclude``."""
    found: dict[str, list[dict]] = {}
    for package in tomllib.loads(lock.read_text())["package"]:
        if package.get("source", {}).get("registry") != PYPI:
            continue
        if any(fnmatch.fnmatch(package["name"], pattern) for pattern in exclude):
            continue
        found.setdefault(package["name"], []).append(package)
    return {name: _linux_x86(entries)["version"] for name, entries in sorted(found.items())}


def _linux_x86(entries: list[dict]) -> dict:
    if len(entries) == 1:
        return entries[0]
    for entry in entries:
        if any(LINUX_X86 in marker for marker in entry.get("resolution-markers", ())):
            return entry
    raise ValueError(f"{entries[0]['name']}: {len(entries)} versions in the lock, none for Linux x86_64")


def constraints(lock: Path, exclude: tuple[str, ...] = (), extra: tuple[str, ...] = ()) -> str:
    """The pins as a pip constraints file, ``extra`` lines (e.g. ``torch==2.13.0``) first."""
    lines = [*extra, *(f"{name}=={version}" for name, version in pins(lock, exclude).items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(f"usage: {sys.argv[0]} LOCK [EXCLUDE ...]")
    sys.stdout.write(constraints(Path(sys.argv[1]), tuple(sys.argv[2:])))
