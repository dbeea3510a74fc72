"""Source checkouts for frameworks that are not on PyPI (NeMo-RL): one exported tree per tag.

A cell of such a framework names the variable holding a user's own clone (``NEMO_RL_SRC``);
each tag's package (and the other paths ``export`` lists, e.g. NeMo-RL's ``examples`` for its
entry point) is exported from that clone (``git archive``) into ``compat/.sources/``
(gitignored) and put on ``PYTHONPATH``. A package the framework pins as a git submodule (NeMo-RL's
``nemo_automodel``) is exported at the commit the tag records, from the clone its own
variable names (``AUTOMODEL_SRC``); without it, the tests that need it skip and say so.
Nothing of the framework is ever committed here.
"""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

from matrix import ROOT, Cell

SOURCES = ROOT / "compat" / ".sources"


def export(clone: Path, ref: str, paths: list[str], dest: Path) -> Path:
    """Export ``paths`` of ``ref`` from the git ``clone`` into ``dest`` (each once)."""
    missing = [p for p in paths if not (dest / p).exists()]
    if not missing:
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    git = ["git", f"--git-dir={_git_dir(clone)}"]
    archive = dest / "src.tar"
    subprocess.run([*git, "archive", "-o", str(archive), ref, *missing], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()
    return dest


def _git_dir(clone: Path) -> str:
    return str(clone / ".git" if (clone / ".git").exists() else clone)


def submodule_commit(clone: Path, ref: str, path: str) -> str:
    """The commit ``ref`` pins for the submodule at ``path``."""
    out = subprocess.run(["git", f"--git-dir={_git_dir(clone)}", "ls-tree", ref, path], check=True,
                         capture_output=True, text=True).stdout.split()
    if len(out) < 3 or out[1] != "commit":
        raise ValueError(f"{ref}:{path} is not a submodule in {clone}")
    return out[2]


def prepare_source(cell: Cell) -> list[Path]:
    """The directories to put on ``PYTHONPATH`` for ``cell`` (exported once per tag)."""
    clone = Path(os.environ[cell.source_env]).expanduser()  # type: ignore[index]
    ref = cell.env.get("GIT_REF", cell.version)
    paths = list(cell.export) or [cell.env.get("PACKAGE", cell.framework)]
    commit = subprocess.run(["git", f"--git-dir={_git_dir(clone)}", "rev-parse", f"{ref}^{{commit}}"], check=True,
                            capture_output=True, text=True).stdout.strip()
    dirs = [export(clone, ref, paths, SOURCES / f"{cell.framework}-{cell.version}-{commit[:7]}")]  # main moves
    for sub in cell.submodules:
        other = os.environ.get(sub["source_env"])
        if not other:
            continue
        pinned = submodule_commit(clone, ref, sub["path"])
        dirs.append(export(Path(other).expanduser(), pinned, [sub["package"]], SOURCES / f"{sub['package']}-{pinned[:7]}"))
    return dirs
