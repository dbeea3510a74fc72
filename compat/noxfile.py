"""The compat matrix as nox sessions: one per (tier, framework version) of ``matrix.toml``.

    nox -f compat/noxfile.py -l                  # list the cells
    nox -f compat/noxfile.py -t ci               # what CI runs (cpu tier, cells marked ci)
    nox -f compat/noxfile.py -t cpu              # every cpu cell
    nox -f compat/noxfile.py -t gpu              # the gpu tier (on a CUDA machine)
    nox -f compat/noxfile.py -t e2e              # the end-to-end tier (cells with e2e = true)
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
from matrix import ROOT, Cell, load  # noqa: E402
from sources import prepare_checkouts, prepare_source  # noqa: E402
from uv_lock import constraints as lock_constraints  # noqa: E402

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


def _write_record(name: str, **fields: object) -> None:
    """``compat/.results/<name>.json``, read with the junit report ``<name>.xml`` by report.py."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"date": datetime.date.today().isoformat(), **fields}
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=2))


def _record(cell: Cell, tier: str, **fields: object) -> None:
    _write_record(f"{tier}-{cell.name}", framework=cell.framework, version=cell.version, tier=tier, python=cell.python,
                  **fields)


def _constraints(session: nox.Session, cell: Cell, source: list[Path] | None = None) -> str:
    """constraints.txt, or for a cell with its own torch a copy pinning that torch (and, for a cell
    with a ``lock``, the pins of the source's own lock file: open-instruct's uv.lock)."""
    if not cell.torch and not cell.lock:
        return str(CONSTRAINTS)
    torch = [f"torch=={cell.torch}"] if cell.torch else [line for line in CONSTRAINTS.read_text().splitlines()
                                                         if line.startswith("torch")]
    path = Path(session.create_tmp()) / "constraints.txt"
    if cell.lock:
        lock = next((d / cell.lock for d in source or () if (d / cell.lock).exists()), None)
        if lock is None:
            session.error(f"{cell.name}: no {cell.lock} in the exported source (add it to the framework's export)")
        path.write_text(lock_constraints(lock, cell.lock_exclude, tuple(torch)))
    else:
        path.write_text("\n".join(torch) + "\n")
    return str(path)


READY_PTH = "_compat_ready_venv.pth"


def _layer_on(session: nox.Session, ready: str) -> None:
    """Let the session's venv see a ready venv's packages (``venv_env``), nothing installed into
    that one: a ``.pth`` appends its site-packages after the session's own."""
    sites = sorted(Path(ready).glob("lib/python3*/site-packages"))
    if not sites:
        session.error(f"{ready}: no lib/python3*/site-packages (is it a virtual environment?)")
    purelib = session.run_install("python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                                  silent=True).strip().splitlines()[-1]  # run_install: also under --install-only
    (Path(purelib) / READY_PTH).write_text(f"import site; site.addsitedir({str(sites[0])!r})\n")


def _layer_off(session: nox.Session) -> None:
    """A reused session venv forgets a ready venv it was layered on before."""
    for path in Path(session.virtualenv.location).glob(f"lib/python3*/site-packages/{READY_PTH}"):
        path.unlink()


def _run_cell(session: nox.Session, cell: Cell, tier: str) -> None:
    junit = RESULTS / f"{tier}-{cell.name}.xml"
    junit.unlink(missing_ok=True)
    why = cell.missing_source()
    if why is None and tier == "gpu" and not _gpu():
        why = "not run: no GPU on this machine"
    if why:
        _record(cell, tier, status="skipped", reason=why)
        session.skip(why)
    ready = cell.ready_venv()
    paths = prepare_source(cell) if cell.source_env else []
    if ready:
        _layer_on(session, ready)
        session.install("pytest")
    else:
        _layer_off(session)
        pins = _constraints(session, cell, paths)
        session.install("-c", pins, "torch")
        if cell.no_deps:
            session.install("-c", pins, "--no-deps", *cell.no_deps)
        if cell.from_checkout:  # packages at commits no release has, exported from the user's clones
            session.install("-c", pins, "--no-deps", *map(str, prepare_checkouts(cell)))
        if cell.no_build_isolation:  # sdists whose build imports the venv's torch (deepspeed)
            session.install("-c", pins, *cell.build_requires)
            session.install("-c", pins, "--no-build-isolation", *cell.no_build_isolation, env=cell.env)
        extra = cell.gpu_install if tier == "gpu" else ()
        session.install("-c", pins, *cell.install, *extra, "pytest", "hypothesis", "pluggy", "wrapt", "packaging")
    session.install("--no-deps", "-e", str(ROOT), "-e", str(ROOT / "tests" / "grpo-patches-testing"))  # the project, its test kit
    if cell.after_install and not ready:  # e.g. open-instruct's DeepSpeed CPU op, built once into the venv
        session.run_install(*cell.after_install, env=cell.env)
    RESULTS.mkdir(parents=True, exist_ok=True)
    _venv_note(cell).write_text(str(session.virtualenv.location))  # where the e2e tier finds this cell's venv
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "GRPO_PATCHES_TIER": tier, **cell.env}
    source = None
    if cell.source_env:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in paths)
        source = ", ".join(p.name for p in paths)
    installed = session.run("python", "-m", "pip", "list", "--format=json", silent=True, env=env) or "[]"
    versions = {p["name"].lower(): p["version"] for p in json.loads(installed)}
    versions[cell.framework] = versions.get(cell.framework) or source
    session.chdir(ROOT)
    if "--install-only" in sys.argv:  # preparing the venv (e.g. for benchmarks/frameworks.py): no result
        return
    _record(cell, tier, status="ran", installed={k: versions.get(k) for k in ("torch", "transformers", cell.framework)},
            **({"venv": f"${cell.venv_env}"} if ready else {}))  # the variable: no path of this machine
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                *cell.tests_for(tier), *session.posargs, env=env, external=False)


def _venv_note(cell: Cell) -> Path:
    return RESULTS / f"venv-cpu-{cell.name}.txt"


def _run_e2e(session: nox.Session, cell: Cell) -> None:
    """The e2e tier in the cell's cpu venv (its session runs first: ``requires``), nothing installed."""
    junit = RESULTS / f"e2e-{cell.name}.xml"
    junit.unlink(missing_ok=True)
    note = _venv_note(cell)
    python = Path(note.read_text().strip(), "bin", "python") if note.exists() else None
    if python is None or not python.exists():
        session.error(f"no venv of cpu-{cell.name} ({note} names none): run that session first")
    if "--install-only" in sys.argv:
        return
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "GRPO_PATCHES_TIER": "e2e", **cell.env}
    installed = session.run(str(python), "-m", "pip", "list", "--format=json", silent=True, env=env,
                            external=True) or "[]"
    versions = {p["name"].lower(): p["version"] for p in json.loads(installed)}
    session.chdir(ROOT)
    _record(cell, "e2e", status="ran", installed={k: versions.get(k) for k in ("torch", "transformers", cell.framework)})
    session.run(str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                *cell.tests_for("e2e"), *session.posargs, env=env, external=True)


def _register(cell: Cell, tier: str) -> None:
    ci = cell.ci if tier == "cpu" else cell.e2e_ci if tier == "e2e" else False
    tags = [tier, cell.framework] + (["ci"] if ci else [])

    def run(session: nox.Session) -> None:
        if tier == "e2e":
            _run_e2e(session, cell)
        else:
            _run_cell(session, cell, tier)

    run.__doc__ = f"{cell.framework} {cell.version} ({tier} tier)"
    if tier == "e2e":  # runs in the cpu cell's venv: that session goes first
        nox.session(name=f"e2e-{cell.name}", venv_backend="none", requires=[f"cpu-{cell.name}"], tags=tags)(run)
    else:
        nox.session(name=f"{tier}-{cell.name}", python=_interpreter(cell.python), tags=tags)(run)


for _cell in load():
    for _tier in _cell.tiers:
        _register(_cell, _tier)

#: The Ray test's pins: driver and bare worker venvs must hold the same Ray and Python minor.
RAY = "2.60.0"
RAY_PYTHON = "3.11"


@nox.session(name="ray-startup", python=_interpreter(RAY_PYTHON), tags=["ci", "ray"])
def ray_startup(session: nox.Session) -> None:
    """The start-up directory reaches Ray actors of a venv without grpo_patches (tests/test_ray_startup.py);
    patch proxies survive Ray's by-value shipping of actor classes (tests/test_patch_pickling.py).

    The bare worker venv (ray, wrapt, packaging only) is made once under .cache/ (gitignored)."""
    session.install("-c", str(CONSTRAINTS), f"ray=={RAY}", "pytest", "pluggy", "wrapt", "packaging")
    session.install("--no-deps", "-e", str(ROOT), "-e", str(ROOT / "tests" / "grpo-patches-testing"))  # the project, its test kit
    bare = ROOT / ".cache" / f"ray-worker-bare-py{RAY_PYTHON}-ray{RAY}"
    python = bare / "bin" / "python"
    if not (bare / ".ready").exists():
        session.run_install("python", "-m", "venv", "--clear", str(bare))  # run_install: --install-only makes it too
        session.run_install(str(python), "-m", "pip", "install", "-q", f"ray=={RAY}", "wrapt", "packaging",
                            external=True)
        (bare / ".ready").write_text(RAY)
    session.chdir(ROOT)
    if "--install-only" in sys.argv:
        return
    junit = RESULTS / "cpu-ray-startup.xml"
    junit.unlink(missing_ok=True)
    _write_record("cpu-ray-startup", session="ray-startup", framework="ray-startup", version=f"ray {RAY}", tier="cpu",
                  python=RAY_PYTHON, status="ran", installed={"ray": RAY})
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                "tests/test_ray_startup.py",
                "tests/test_patch_pickling.py",  # patch proxies shipped the way Ray ships actor classes (ray.cloudpickle)
                *session.posargs, env={"GRPO_PATCHES_RAY_WORKER_PYTHON": str(python)})
