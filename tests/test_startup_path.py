"""The start-up directory (``grpo-patches run`` / ``env``): patches a Python whose environment lacks grpo_patches.

A fresh virtual environment (no grpo_patches, no pluggy, no torch) stands for a Ray worker's
venv; its "own" packages (wrapt, packaging: NeMo-RL's worker venvs have them) sit on its path.
The real Ray cluster test is ``tests/test_ray_startup.py`` (compat session ``ray-startup``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_patches import startup_path
from grpo_patches.cli import main
from tests.helpers.fakefw_site import make_site

REPORT = r"""
import importlib.util, json, os, sys
import fakefw.worker
import grpo_patches
def where(name):
    spec = importlib.util.find_spec(name)
    return spec.origin if spec else None
entry = grpo_patches.status()["fakefw"]
print(json.dumps({
    "result": fakefw.worker.work(2), "patched": entry["patched"], "process": entry["process"],
    "grpo_patches": grpo_patches.__file__, "pluggy": where("pluggy"), "wrapt": where("wrapt"),
    "torch": where("torch"), "decoy": os.environ.get("DECOY_SITECUSTOMIZE_RAN"), "executable": sys.executable,
}))
"""


def _package(name: str) -> Path:
    return Path(list(importlib.util.find_spec(name).submodule_search_locations)[0])


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> tuple[str, Path]:
    """A venv without grpo_patches, and a directory of the packages it has of its own."""
    root = tmp_path_factory.mktemp("bare")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
    own = root / "own"
    for name in ("wrapt", "packaging"):
        shutil.copytree(_package(name), own / name)
    (own / "sitecustomize.py").write_text("import os\nos.environ['DECOY_SITECUSTOMIZE_RAN'] = '1'\n")
    return str(root / "venv" / "bin" / "python"), own


def test_build_lays_out_the_directory_and_reuses_it(tmp_path):
    built = startup_path.build(tmp_path / "startup")
    assert (built / "sitecustomize.py").is_file()
    lib = built / startup_path.LIB
    assert sorted(p.name for p in lib.iterdir()) == ["grpo_patches", "pluggy"]
    assert (lib / "grpo_patches" / "adapters" / "nemo_rl" / "__init__.py").is_file()
    assert not list(lib.rglob("__pycache__"))
    stamp = (built / ".fingerprint").stat().st_mtime_ns
    assert startup_path.build(tmp_path / "startup") == built and (built / ".fingerprint").stat().st_mtime_ns == stamp


def test_environment_prepends_the_directory_once(tmp_path):
    env = startup_path.environment(tmp_path, "nemo_rl", "tiled_loss=1",
                                   environ={"PYTHONPATH": os.pathsep.join(["/a", str(tmp_path.resolve())])})
    assert env["PYTHONPATH"] == os.pathsep.join([str(tmp_path.resolve()), "/a"])
    assert env["GRPO_PATCHES"] == "nemo_rl" and env["GRPO_PATCHES_OPTIONS"] == "tiled_loss=1"
    assert env["GRPO_PATCHES_STARTUP_DIR"] == str(tmp_path.resolve())


def test_a_python_without_grpo_patches_is_patched(tmp_path, bare_python):
    python, own = bare_python
    site = make_site(tmp_path / "site")
    built = startup_path.build(tmp_path / "startup")
    env = startup_path.environment(built, "fakefw", environ={"PYTHONPATH": os.pathsep.join([str(own), str(site)])})
    proc = subprocess.run([python, "-c", REPORT], env={"PATH": os.environ["PATH"], **env}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["result"] == ["patched", 20, None] and out["patched"] is True
    assert out["process"] == f"pid {out['process'].split()[1]} ({python})"
    lib = str(built / startup_path.LIB)
    assert out["grpo_patches"].startswith(lib) and out["pluggy"].startswith(lib)
    assert out["wrapt"].startswith(str(own))  # the process's own packages win
    assert out["torch"] is None  # nothing else of the driver's environment
    assert out["decoy"] == "1"  # the sitecustomize it shadows still runs


def test_without_the_variable_nothing_is_enabled(tmp_path, bare_python):
    python, own = bare_python
    built = startup_path.build(tmp_path / "startup")
    env = startup_path.environment(built, "", environ={"PYTHONPATH": str(own)})
    code = "import sys, json; print(json.dumps('grpo_patches' in sys.modules))"
    proc = subprocess.run([python, "-c", code], env={"PATH": os.environ["PATH"], **env}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and json.loads(proc.stdout) is False and proc.stderr == ""


def test_cli_env_prints_the_variables(tmp_path, capsys):
    assert main(["env", "--frameworks", "nemo_rl", "--options", "tile_size=64", "--dir", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert f"export PYTHONPATH={(tmp_path / 'd').resolve()}" in out
    assert "export GRPO_PATCHES=nemo_rl" in out and "export GRPO_PATCHES_OPTIONS=tile_size=64" in out


def test_cli_rejects_a_malformed_option(tmp_path, capsys):
    assert main(["env", "--options", "tile_size=big", "--dir", str(tmp_path / "d")]) == 2
    assert "option 'tile_size' must be an int" in capsys.readouterr().err


def test_cli_run_starts_the_command_with_the_variables(tmp_path):
    code = "import os, json; print(json.dumps([os.environ['GRPO_PATCHES'], os.environ['PYTHONPATH']]))"
    cli = [sys.executable, "-m", "grpo_patches.cli", "run", "--frameworks", "fakefw", "--dir", str(tmp_path / "d"),
           "--", sys.executable, "-c", code]
    proc = subprocess.run(cli, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if not k.startswith("GRPO_PATCHES")})
    assert proc.returncode == 0, proc.stderr
    frameworks, pythonpath = json.loads(proc.stdout.strip().splitlines()[-1])
    assert frameworks == "fakefw" and pythonpath.split(os.pathsep)[0] == str((tmp_path / "d").resolve())
