"""Which interpreter runs each framework in ``frameworks.py``, and where it came from.

Given (``--python NAME=PATH``, else ``$GRPO_BENCH_PYTHON_<NAME>``): that interpreter, nothing
else. Otherwise the candidates are the interpreter running ``frameworks.py`` (the project's
``.venv`` through ``bash scripts/run frameworks``) and every compat venv (``compat/.nox/*``,
made by ``bash scripts/run compat``); each is asked which framework versions it holds, and the
**newest version that the adapter supports and the runner runs** wins (a tie goes to the
earlier candidate). NeMo-RL and open-instruct are not installed but exported from a clone
(``$NEMO_RL_SRC``, ``$OPEN_INSTRUCT_SRC``: :data:`SOURCE_CHECKOUTS`), one tag per interpreter: their
candidates are the matrix's tags, each with the compat venv of its cell
(``compat/.nox/cpu-<name>-<tag>``), newest tag first, or the tag ``--nemo-rl-tag`` /
``--open-instruct-tag`` names.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent

#: The versions each runner (``fw_<name>.py``) runs, within the adapter's supported range;
#: a runner asked for another answers "not run". verl: the legacy worker line (verl_v1: the engine
#: line through main_ppo's V1 trainer, 0.9+); NeMo-RL: v0.6.0 (in-process), v0.7.0 and main (run_grpo.py;
#: v0.5.0 needs its own worker environment).
RUNS = {"trl": "", "verl": "<0.8", "verl_v1": ">=0.9", "nemo_rl": ">=0.6.0", "open_instruct": ""}
#: Frameworks run from a clone, exported per tag onto ``PYTHONPATH``: name -> the variable naming the clone.
SOURCE_CHECKOUTS = {"nemo_rl": "NEMO_RL_SRC", "open_instruct": "OPEN_INSTRUCT_SRC"}
#: Distribution whose version the probe reads (NeMo-RL's comes from the tag instead).
DISTRIBUTIONS = {"trl": "trl", "verl": "verl", "verl_v1": "verl"}

PROBE = (
    "import importlib.metadata as m, importlib.util as u, json\n"
    "def v(d):\n"
    "    try:\n        return m.version(d)\n"
    "    except m.PackageNotFoundError:\n        return None\n"
    "print(json.dumps({'grpo_patches': u.find_spec('grpo_patches') is not None,\n"
    "                  'versions': {d: v(d) for d in %r}}))\n" % (sorted(set(DISTRIBUTIONS.values())),)
)


@dataclass(frozen=True)
class Interpreter:
    """A candidate interpreter for one framework."""

    python: str
    origin: str  # where it came from, printed and written into the report
    version: str | None  # the framework's version there (None: not installed)
    tag: str | None = None  # a framework run from a clone: the tag exported onto its PYTHONPATH


def shown(path: str | Path, root: Path = ROOT) -> str:
    """``path`` relative to the checkout when inside it; never a path of this machine outside it."""
    try:
        return str(Path(path).absolute().relative_to(root))
    except ValueError:
        return "<outside the checkout>"


def nox_dir(session: str) -> str:
    """The folder nox gives a session's venv (its own rule: ``-`` for every other character)."""
    name = re.sub(r"[^\w\s-]", "-", session).strip().lower()
    return re.sub(r"[-\s]+", "-", name).strip("-")


def compat_venvs(root: Path = ROOT) -> list[Path]:
    """Every compat venv's interpreter, in name order."""
    return sorted((root / "compat" / ".nox").glob("*/bin/python"))


def probe(python: str) -> dict | None:
    """What ``python`` holds: ``{"grpo_patches": bool, "versions": {distribution: version|None}}``
    (None when it does not run)."""
    try:
        out = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=120,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def choose(name: str, candidates: list[Interpreter], supported: str) -> tuple[Interpreter | None, str]:
    """The candidate with the newest ``name`` version in ``supported`` (the adapter's range) and
    :data:`RUNS` (the runner's); the earlier candidate on a tie. Returns it (or None) and why."""
    from packaging.specifiers import SpecifierSet  # here: frameworks.py may start in a Python without it
    from packaging.version import Version

    allowed = SpecifierSet(supported) & SpecifierSet(RUNS[name])
    usable = [c for c in candidates if c.version is not None and allowed.contains(Version(c.version), prereleases=True)]
    if usable:
        best = max(usable, key=lambda c: (Version(c.version), -candidates.index(c)))
        return best, best.origin
    found = "; ".join(f"{name} {c.version} in {c.origin}" if c.version else f"no {name} in {c.origin}"
                      for c in candidates) or "no candidate"
    return None, f"no interpreter with a {name} version in {allowed or 'any'} ({found})"


def candidates(name: str, given: dict[str, str], tags: list[tuple[str, str]], chosen_tag: str | None,
               root: Path = ROOT, probe: Callable[[str], dict | None] = probe) -> list[Interpreter]:
    """Every interpreter that could run ``name``, in preference order.

    :param given: ``--python`` choices (NAME -> PATH); ``$GRPO_BENCH_PYTHON_<NAME>`` is read here.
    :param tags: a clone-run framework's matrix tags as (tag, the version the adapter reads from it).
    :param chosen_tag: its ``--nemo-rl-tag`` / ``--open-instruct-tag`` (None: every tag).
    """
    variable = f"GRPO_BENCH_PYTHON_{name.upper()}"
    explicit = ((given[name], "--python") if name in given else
                (os.environ[variable], f"${variable}") if os.environ.get(variable) else None)
    if name in SOURCE_CHECKOUTS:
        out = []
        for tag, version in tags:
            if chosen_tag not in (None, tag):
                continue
            if explicit:
                out.append(Interpreter(explicit[0], f"{explicit[1]}, tag {tag}", version, tag))
            else:
                venv = root / "compat" / ".nox" / nox_dir(f"cpu-{name}-{tag}") / "bin" / "python"
                if venv.exists():
                    out.append(Interpreter(str(venv), f"compat venv {shown(venv.parent.parent, root)}", version, tag))
        return out
    pythons = [explicit] if explicit else [(sys.executable, f"this interpreter ({shown(sys.executable, root)})")] + [
        (str(p), f"compat venv {shown(p.parent.parent, root)}") for p in compat_venvs(root)]
    out = []
    for python, origin in pythons:
        held = probe(python)
        if held is None:
            out.append(Interpreter(python, f"{origin}: does not run", None))
            continue
        version = held["versions"].get(DISTRIBUTIONS[name])
        if version is not None and not held["grpo_patches"]:
            origin += ": no grpo_patches"
            version = None
        out.append(Interpreter(python, origin, version))
    return out
