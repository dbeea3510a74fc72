"""The compat matrix as nox sessions: one per (tier, framework version) of ``matrix.toml``.

    nox -f compat/noxfile.py -l                  # list the cells
    nox -f compat/noxfile.py -t ci               # what CI runs (cpu tier, cells marked ci)
    nox -f compat/noxfile.py -t cpu              # every cpu cell
    nox -f compat/noxfile.py -t gpu              # the gpu tier (on a CUDA machine)
    nox -f compat/noxfile.py -s "cpu-verl-0.9.1"

``bash scripts/run compat [TAG]`` runs the sessions with venv reuse and then writes
``compat/RESULTS.md`` and ``compat/results.json`` (``compat/report.py``). Each session leaves
a junit XML and a JSON record in ``compat/.results/``; venvs live in ``compat/.nox/``
(both gitignored; reused between runs).
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nox

sys.path.insert(0, str(Path(__file__).resolve().parent))
from matrix import ROOT, TIERS, Cell, load  # noqa: E402
from sources import prepare_source  # noqa: E402

RESULTS = ROOT / "compat" / ".results"
CONSTRAINTS = ROOT / "constraints.txt"
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = False


def _interpreter(version: str) -> str:
    """``pythonX.Y``, or pyenv's own copy of it (pyenv shims refuse versions not selected)."""
    pattern = os.path.expanduser(f"~/.pyenv/versions/{version}*/bin/python{version}")
    found = sorted(glob.glob(pattern))
    return found[-1] if found else f"python{version}"


def _gpu() -> bool:
    return shutil.which("nvidia-smi") is not None and subprocess.run(["nvidia-smi"], capture_output=True).returncode == 0


def _record(cell: Cell, tier: str, **fields: object) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"framework": cell.framework, "version": cell.version, "tier": tier, "python": cell.python,
              "date": datetime.date.today().isoformat(), **fields}
    (RESULTS / f"{tier}-{cell.name}.json").write_text(json.dumps(record, indent=2))


def _constraints(session: nox.Session, cell: Cell) -> str:
    """constraints.txt, or for a cell with its own torch a copy pinning that torch."""
    if not cell.torch:
        return str(CONSTRAINTS)
    path = Path(session.create_tmp()) / "constraints.txt"
    path.write_text(f"torch=={cell.torch}\n")
    return str(path)


def _run_cell(session: nox.Session, cell: Cell, tier: str) -> None:
    junit = RESULTS / f"{tier}-{cell.name}.xml"
    junit.unlink(missing_ok=True)
    why = cell.missing_source()
    if why is None and tier == "gpu" and not _gpu():
        why = "not run: no GPU on this machine"
    if why:
        _record(cell, tier, status="skipped", reason=why)
        session.skip(why)
    pins = _constraints(session, cell)
    session.install("-c", pins, "torch")
    if cell.no_deps:
        session.install("-c", pins, "--no-deps", *cell.no_deps)
    extra = cell.gpu_install if tier == "gpu" else ()
    session.install("-c", pins, *cell.install, *extra, "pytest", "hypothesis", "pluggy", "wrapt", "packaging")
    session.install("--no-deps", "-e", str(ROOT))
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "GRPO_PATCHES_TIER": tier, **cell.env}
    if cell.source_env:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in prepare_source(cell))
    installed = session.run("python", "-m", "pip", "list", "--format=json", silent=True, env=env) or "[]"
    versions = {p["name"].lower(): p["version"] for p in json.loads(installed)}
    session.chdir(ROOT)
    _record(cell, tier, status="ran", installed={k: versions.get(k) for k in ("torch", "transformers", cell.framework)})
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                *cell.tests_for(tier), *session.posargs, env=env, external=False)


def _register(cell: Cell, tier: str) -> None:
    tags = [tier, cell.framework] + (["ci"] if cell.ci and tier == "cpu" else [])

    def run(session: nox.Session) -> None:
        _run_cell(session, cell, tier)

    run.__doc__ = f"{cell.framework} {cell.version} ({tier} tier)"
    nox.session(name=f"{tier}-{cell.name}", python=_interpreter(cell.python), tags=tags)(run)


for _cell in load():
    for _tier in TIERS:
        _register(_cell, _tier)
