"""Source checkouts for frameworks that are not on PyPI (NeMo-RL): one exported tree per tag.

A cell of such a framework names the variable holding a user's own clone (``NEMO_RL_SRC``);
each tag is exported from that clone (``git archive``) into ``compat/.sources/`` (gitignored)
and put on ``PYTHONPATH``. Nothing of the framework is ever committed here.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

from matrix import ROOT, Cell

SOURCES = ROOT / "compat" / ".sources"


def export(clone: Path, ref: str, paths: list[str], dest: Path) -> Path:
    """Export ``paths`` of ``ref`` from the git ``clone`` into ``dest`` (once)."""
    if dest.is_dir() and any(dest.iterdir()):
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    git = ["git", f"--git-dir={clone / '.git' if (clone / '.git').exists() else clone}"]
    archive = dest / "src.tar"
    subprocess.run([*git, "archive", "-o", str(archive), ref, *paths], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()
    return dest


def prepare_source(cell: Cell) -> list[Path]:
    """The directories to put on ``PYTHONPATH`` for ``cell`` (exported once per tag)."""
    clone = Path(os.environ[cell.source_env]).expanduser()  # type: ignore[index]
    ref = cell.env.get("GIT_REF", cell.version)
    package = cell.env.get("PACKAGE", cell.framework)
    return [export(clone, ref, [package], SOURCES / f"{cell.framework}-{cell.version}")]
