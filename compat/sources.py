"""Source checkouts for frameworks that are not on PyPI (NeMo-RL): one exported tree per tag.

A cell of such a framework names the variable holding a user's own clone (``NEMO_RL_SRC``);
each tag's package (and the other paths ``export`` lists, e.g. NeMo-RL's ``examples`` for its
entry point) is exported from that clone (``git archive``) into ``compat/.sources/``
(gitignored) and put on ``PYTHONPATH``. A package the framework pins as a git submodule (NeMo-RL's
``nemo_automodel``) is exported at the commit the tag records, from the clone its own
variable names (``AUTOMODEL_SRC``); without it, the tests that need it skip and say so.
Packages a cell builds from a checkout (``from_checkout``: NeMo-RL's megatron-core and
Megatron-Bridge at the commits its tags pin) are exported the same way, from the clone their
variable names (``MEGATRON_LM_SRC``), for nox to pip-install ``--no-deps``.
Nothing of the framework is ever committed here.

    python compat/sources.py nemo_rl-v0.6.0-megatron   # export a cell's checkout packages, print their dirs
"""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

from matrix import ROOT, Cell, load

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


def prepare_checkouts(cell: Cell) -> list[Path]:
    """The exported trees of ``cell``'s ``from_checkout`` packages (one per package and commit),
    to pip-install ``--no-deps``; each variable must name a clone holding the commit."""
    dirs = []
    for checkout in cell.from_checkout:
        clone = Path(os.environ[checkout.source_env]).expanduser()
        dest = SOURCES / f"{checkout.package}-{checkout.commit[:7]}"
        dirs.append(export(clone, checkout.commit, list(checkout.paths), dest))
    return dirs


if __name__ == "__main__":
    import sys

    cells = {c.name: c for c in load()}
    if len(sys.argv) != 2 or sys.argv[1] not in cells:
        sys.exit(f"usage: {sys.argv[0]} CELL (one of: {', '.join(n for n, c in cells.items() if c.from_checkout)})")
    print("\n".join(str(d) for d in prepare_checkouts(cells[sys.argv[1]])))
