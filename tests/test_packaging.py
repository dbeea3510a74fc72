"""Release path: sdist -> wheel built from that sdist -> a fresh venv -> ``GRPO_PATCHES=trl`` works.

This is what ``pip install grpo-patches`` from an sdist does. The fresh venv gets only the
wheel; its dependencies (torch, TRL, ...) are borrowed from the test venv through a plain
path entry, whose own ``.pth`` files (the editable install, its start-up ``.pth``) are not
processed, so everything of grpo_patches comes from the wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import venv
from pathlib import Path

import pytest

import grpo_patches

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def _clean_copy(dest: Path) -> Path:
    """The project's files as a fresh checkout has them (an existing egg-info's SOURCES.txt
    would otherwise smuggle files into the sdist that a clean checkout lacks)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: cannot tell which files a clean checkout has")
    for name in listed.stdout.splitlines():
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel_from_sdist(tmp_path_factory) -> Path:
    pytest.importorskip("build")
    out = tmp_path_factory.mktemp("dist")
    source = _clean_copy(tmp_path_factory.mktemp("checkout"))
    _run([sys.executable, "-m", "build", "--sdist", "--outdir", str(out), str(source)])
    (sdist,) = out.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        tar.extractall(out / "unpacked", filter="data")
    assert any(n.endswith("_build/backend.py") for n in names), "the sdist lacks the build backend"
    (src,) = (out / "unpacked").iterdir()
    _run([sys.executable, "-m", "build", "--wheel", "--outdir", str(out / "wheel"), str(src)])
    (wheel,) = (out / "wheel").glob("*.whl")
    return wheel


def test_the_wheel_built_from_the_sdist_installs_and_patches(wheel_from_sdist, tmp_path):
    pytest.importorskip("trl")
    env_dir = tmp_path / "fresh"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel_from_sdist)])
    purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    assert (purelib / "grpo_patches_startup.pth").is_file(), "the start-up .pth is not at the site-packages root"
    assert (purelib / "grpo_patches" / "adapters" / "trl" / "__init__.py").is_file()
    assert (purelib / "grpo_patches" / "demo" / "compare.py").is_file()  # the demo's sub-package
    assert not (purelib / "grpo_patches" / "testing").exists(), "the test kit is its own distribution"
    assert not (purelib / "grpo_patches_testing").exists(), "the test kit is its own distribution"
    assert not (purelib / "adapters").exists(), "adapters must install as grpo_patches.adapters only"
    (dist_info,) = purelib.glob(f"grpo_patches-{grpo_patches.__version__}.dist-info")
    assert (dist_info / "licenses" / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()
    assert "License-Expression: Apache-2.0" in (dist_info / "METADATA").read_text()
    (purelib / "borrowed_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    version = _run([str(env_dir / "bin" / "grpo-patches"), "--version"]).stdout.strip()
    assert version == f"grpo-patches {grpo_patches.__version__}", version

    code = (
        "import json, sys, grpo_patches\n"
        "pending = grpo_patches.status()['trl']['pending_import']\n"
        "import trl.trainer.grpo_trainer as g\n"
        "print(json.dumps({'file': grpo_patches.__file__, 'pending': pending,\n"
        "                  'wrapped': type(vars(g.GRPOTrainer)['training_step']).__name__,\n"
        "                  'patched': grpo_patches.status()['trl']['patched']}))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRPO_PATCHES", "PYTHON"))}
    out = json.loads(_run([str(python), "-c", code], env={**env, "GRPO_PATCHES": "trl"}, cwd=tmp_path).stdout.splitlines()[-1])
    assert out["file"].startswith(str(purelib)), out["file"]
    assert out == {**out, "pending": True, "wrapped": "FunctionWrapper", "patched": True}


def _fake_cuda_torch(folder: Path, version: str = "2.9.1+cu128") -> Path:
    """A wheel that installs as ``torch`` ``version``: what a GPU user's CUDA build looks like to pip."""
    import zipfile

    name = f"torch-{version}.dist-info"
    files = {"torch/__init__.py": f"__version__ = {version!r}\n",
             f"{name}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n",
             f"{name}/WHEEL": "Wheel-Version: 1.0\nGenerator: grpo-patches-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    path = folder / f"torch-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for file, text in files.items():
            wheel.writestr(file, text)
        wheel.writestr(f"{name}/RECORD", "".join(f"{f},,\n" for f in [*files, f"{name}/RECORD"]))
    return path


@pytest.mark.parametrize("extra", ["torch", "trl"])
def test_installing_into_an_environment_with_a_cuda_torch_keeps_that_torch(wheel_from_sdist, tmp_path, extra):
    """``pip install grpo-patches[<extra>]`` never pins torch: a GPU user's CUDA build stays (what pip would
    install is read from its dry-run report; the package index serves the other requirements)."""
    env_dir = tmp_path / "gpu-user"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(_fake_cuda_torch(tmp_path))])
    report = tmp_path / "report.json"
    proc = subprocess.run([python, "-m", "pip", "install", "--dry-run", "-q", "--report", str(report),
                           f"{wheel_from_sdist}[{extra}]"], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 and "No matching distribution" in proc.stderr + proc.stdout:
        pytest.skip(f"no package index reachable for the [{extra}] requirements")
    assert proc.returncode == 0, proc.stderr[-3000:]
    planned = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in json.loads(report.read_text())["install"]}
    assert "grpo-patches" in planned
    assert "torch" not in planned, f"pip would replace the CUDA torch: {planned.get('torch')}"
