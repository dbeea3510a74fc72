"""One scratch folder per process for everything the kit and the tests write to disk (models,
trainer output, shared workers' files), removed when the process ends: a test run leaves no
folders behind in the system's temp folder."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

#: Prefix of the per-process root, under the system's temp folder.
PREFIX = "grpo_patches_scratch_"

_root: Path | None = None


def root() -> Path:
    """This process's scratch root (made on first use, removed at exit)."""
    global _root
    if _root is None or not _root.exists():
        _root = Path(tempfile.mkdtemp(prefix=PREFIX))
        atexit.register(cleanup)
    return _root


def directory(prefix: str) -> str:
    """A new folder under :func:`root` (``tempfile.mkdtemp``'s contract: unique, empty)."""
    return tempfile.mkdtemp(prefix=prefix, dir=root())


def cleanup() -> None:
    """Remove the scratch root now (safe to call again; atexit calls it too)."""
    global _root
    if _root is not None:
        shutil.rmtree(_root, ignore_errors=True)
        _root = None
