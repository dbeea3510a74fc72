"""The compat matrix (``compat/matrix.toml``) as Python objects, for nox, the report and the tests.

Imports nothing outside the standard library, so nox can load it before any venv exists.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MATRIX = HERE / "matrix.toml"
#: ``e2e``: the framework's real entry point, patched vs unpatched, for cells with ``e2e = true``
#: (run in the cell's cpu venv: no second install).
TIERS = ("cpu", "gpu", "e2e")


@dataclass(frozen=True)
class Checkout:
    """A package a cell builds from a user's checkout (not on PyPI at the commit it needs).

    ``compat/sources.py`` exports ``paths`` of ``commit`` from the clone ``source_env`` names;
    the noxfile pip-installs the exported tree ``--no-deps``.
    """

    package: str
    source_env: str
    commit: str
    paths: tuple[str, ...]


@dataclass(frozen=True)
class Cell:
    """One framework version: how to install it and which tests prove it."""

    framework: str
    version: str
    python: str
    install: tuple[str, ...]
    tests: tuple[str, ...]
    no_deps: tuple[str, ...] = ()  # installed with --no-deps first (verl's own pins would pull CUDA stacks)
    gpu_tests: tuple[str, ...] = ()
    gpu_install: tuple[str, ...] = ()  # extra requirements of the gpu tier (e.g. deepspeed)
    source_env: str | None = None  # run from a checkout named by this variable (NEMO_RL_SRC)
    torch: str | None = None  # a torch other than constraints.txt's (no CPU wheel for that Python)
    ci: bool = False
    env: dict[str, str] = field(default_factory=dict)
    submodules: tuple[dict[str, str], ...] = ()  # packages pinned as git submodules of the source (see sources.py)
    reads_as: str | None = None  # the version the adapter reads from this source (a tag's own number may differ)
    venv_env: str | None = None  # a variable that may name a ready venv with the cell's packages (not installed then)
    e2e_tests: tuple[str, ...] = ()  # the e2e tier's tests (for cells with e2e)
    e2e: bool = False  # the cell has an e2e tier
    e2e_ci: bool = False  # CI runs the cell's e2e tier
    export: tuple[str, ...] = ()  # paths of a source checkout to export (default: the package; see sources.py)
    from_checkout: tuple[Checkout, ...] = ()  # packages built from checkouts when no ready venv is named
    lock: str | None = None  # the source's own lock file (uv.lock), turned into pip constraints (uv_lock.py)
    lock_exclude: tuple[str, ...] = ()  # names (globs) the lock does not constrain: the GPU stack, torch
    no_build_isolation: tuple[str, ...] = ()  # built against the venv's torch (deepspeed's sdist imports it)
    build_requires: tuple[str, ...] = ()  # what those builds import, installed first
    after_install: tuple[str, ...] = ()  # a command run in the venv once the project is installed

    @property
    def name(self) -> str:
        return f"{self.framework}-{self.version}"

    def tests_for(self, tier: str) -> tuple[str, ...]:
        if tier == "e2e":
            return self.e2e_tests if self.e2e else ()
        return self.tests + (self.gpu_tests if tier == "gpu" else ())

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers this cell has (every cell: cpu and gpu; e2e where the matrix says so)."""
        return tuple(t for t in TIERS if t != "e2e" or self.e2e)

    @property
    def adapter_version(self) -> str:
        """The version the adapter sees for this cell (``reads_as``, else the tag without its ``v``)."""
        return self.reads_as or self.version.lstrip("v")

    def ready_venv(self) -> str | None:
        """The ready venv ``venv_env`` names, when it is set and exists."""
        path = os.environ.get(self.venv_env) if self.venv_env else None
        return path if path and os.path.isdir(path) else None

    def missing_source(self) -> str | None:
        """Why this cell cannot run here (``None`` when it can)."""
        if self.source_env and not os.environ.get(self.source_env):
            return f"not run: no source (set {self.source_env} to a checkout of {self.framework})"
        if self.ready_venv():  # it holds the packages built from checkouts
            return None
        for checkout in self.from_checkout:
            if not os.environ.get(checkout.source_env):
                ready = f", or {self.venv_env} to a ready venv" if self.venv_env else ""
                return f"not run: no source (set {checkout.source_env} to a checkout of {checkout.package}{ready})"
        return None


def load(path: Path = MATRIX) -> list[Cell]:
    """Every cell of the matrix, in file order."""
    data = tomllib.loads(path.read_text())
    cells = []
    for framework, spec in data.items():
        for entry in spec["versions"]:
            cells.append(
                Cell(
                    framework=framework,
                    version=entry["version"],
                    python=entry.get("python", spec["python"]),
                    install=tuple(entry.get("install", ())),
                    no_deps=tuple(entry.get("no_deps", ())),
                    tests=tuple(entry.get("tests", spec["tests"])),
                    gpu_tests=tuple(entry.get("gpu_tests", spec.get("gpu_tests", ()))),
                    gpu_install=tuple(entry.get("gpu_install", spec.get("gpu_install", ()))),
                    source_env=spec.get("source_env"),
                    torch=entry.get("torch", spec.get("torch")),
                    ci=bool(entry.get("ci", False)),
                    env=dict(entry.get("env", spec.get("env", {}))),
                    submodules=tuple(spec.get("submodules", ())),
                    reads_as=entry.get("reads_as"),
                    venv_env=entry.get("venv_env", spec.get("venv_env")),
                    e2e_tests=tuple(spec.get("e2e_tests", ())),
                    e2e=bool(entry.get("e2e", False)),
                    e2e_ci=bool(entry.get("e2e_ci", False)),
                    export=tuple(entry.get("export", spec.get("export", ()))),
                    from_checkout=_checkouts(spec, entry),
                    lock=entry.get("lock", spec.get("lock")),
                    lock_exclude=tuple(entry.get("lock_exclude", spec.get("lock_exclude", ()))),
                    no_build_isolation=tuple(entry.get("no_build_isolation", spec.get("no_build_isolation", ()))),
                    build_requires=tuple(entry.get("build_requires", spec.get("build_requires", ()))),
                    after_install=tuple(entry.get("after_install", spec.get("after_install", ()))),
                )
            )
    return cells


def _checkouts(spec: dict, entry: dict) -> tuple[Checkout, ...]:
    """A version's ``from_checkout`` (package -> commit) joined with its framework's ``checkouts``
    (package -> variable and paths to export)."""
    known = spec.get("checkouts", {})
    unknown = set(entry.get("from_checkout", {})) - set(known)
    if unknown:
        raise ValueError(f"{entry['version']}: from_checkout names {sorted(unknown)}, not in the framework's checkouts")
    return tuple(Checkout(package, known[package]["source_env"], commit, tuple(known[package]["export"]))
                 for package, commit in entry.get("from_checkout", {}).items())


#: Sessions the noxfile adds besides one per (tier, cell), with their tags.
EXTRA_SESSIONS = {"ray-startup": ("ci", "ray")}


def sessions() -> list[tuple[str, tuple[str, ...], str]]:
    """``(session, tags, description)`` of every nox session, as compat/noxfile.py registers them."""
    found = []
    for cell in load():
        for tier in cell.tiers:
            ci = cell.ci if tier == "cpu" else cell.e2e_ci if tier == "e2e" else False
            tags = (tier, cell.framework) + (("ci",) if ci else ())
            found.append((f"{tier}-{cell.name}", tags, f"{cell.framework} {cell.version} ({tier} tier)"))
    found += [(name, tags, "the start-up directory reaches Ray workers") for name, tags in EXTRA_SESSIONS.items()]
    return found


def usage() -> str:
    """``bash scripts/run compat --help``: the tags and sessions, from this file alone (no venv)."""
    rows = sessions()
    tags = sorted({t for _, ts, _ in rows for t in ts}, key=lambda t: (t != "ci", t))
    width = max(len(name) for name, _, _ in rows)
    return "\n".join([
        "usage: bash scripts/run compat [TAG | SESSION] [-- PYTEST ARGUMENTS]",
        "       bash scripts/run compat --list    (nox's own listing; needs the project venv)",
        "",
        "Runs the compat cells with nox (venvs under compat/.nox, reused), then writes compat/RESULTS.md and",
        "compat/results.json (COMPAT_REPORT_DIR=DIR: there instead). Cells outside CI read their sources and",
        "ready venvs from variables (compat/README.md). --help and --list change nothing.",
        "",
        f"TAG (default ci): {', '.join(tags)}",
        "SESSION (one cell):",
        *(f"  {name:<{width}}  [{', '.join(ts)}]" for name, ts, _ in rows),
    ])


if __name__ == "__main__":
    print(usage())
