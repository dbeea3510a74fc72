"""Start-up patching through the installed ``.pth`` file, in fresh interpreters."""

from __future__ import annotations

import site
import sys
from pathlib import Path

import pytest

import grpo_patches
from tests.helpers.fakefw_site import make_site, run_script

PATCHED = """
import json, sys
already = 'grpo_patches' in sys.modules
import fakefw.trainer as T
print(json.dumps({'already': already, 'result': T.Trainer().step(1)}))
"""


@pytest.fixture(scope="module")
def fake_site(tmp_path_factory):
    return make_site(tmp_path_factory.mktemp("startup"))


def test_pth_is_installed_next_to_the_package():
    pth = [Path(d) / "grpo_patches_startup.pth" for d in site.getsitepackages()]
    installed = [p for p in pth if p.exists()]
    assert installed, f"no start-up .pth in {site.getsitepackages()}"
    shipped = Path(__file__).resolve().parents[1] / "_build" / "grpo_patches_startup.pth"
    assert installed[0].read_bytes() == shipped.read_bytes()


def test_unset_variable_imports_nothing(fake_site):
    out = run_script(fake_site, "import json, sys; print(json.dumps('grpo_patches' in sys.modules))")
    assert out["out"] is False and out["stderr"] == ""


def test_variable_patches_when_the_framework_is_imported(fake_site):
    out = run_script(fake_site, PATCHED, env={"GRPO_PATCHES": "fakefw", "GRPO_PATCHES_OPTIONS": "tile_size=9"})
    assert out["out"] == {"already": True, "result": ["patched", 2, 9]}
    assert out["stderr"] == ""


def test_all_patches_installed_frameworks(fake_site):
    out = run_script(fake_site, PATCHED, env={"GRPO_PATCHES": "all"})
    assert out["out"]["result"] == ["patched", 2, None]


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"GRPO_PATCHES": "fakefw,bogus"}, "unknown framework(s) 'bogus' (valid: trl, verl, nemo_rl"),
        ({"GRPO_PATCHES": "fakefw", "GRPO_PATCHES_OPTIONS": "recompute=maybe"}, "option 'recompute' must be 1/true/yes/on or 0/false/no/off"),
        ({"GRPO_PATCHES": "fakefw", "GRPO_PATCHES_OPTIONS": "colour=1"}, "unknown option(s) 'colour'"),
        ({"GRPO_PATCHES": "fakefw", "GRPO_PATCHES_OPTIONS": "tile_size"}, "expected name=value"),
    ],
)
def test_malformed_values_are_one_warning_and_never_raise(fake_site, env, needle):
    out = run_script(fake_site, "import json; print(json.dumps('ok'))", env=env)
    assert out["out"] == "ok"
    assert out["stderr"].count("GrpoPatchesWarning") == 1, out["stderr"]
    assert needle in out["stderr"]
    assert out["stderr"].startswith("<start-up: GRPO_PATCHES="), out["stderr"]  # where it comes from, plainly


def test_unsupported_version_is_a_warning_not_a_crash(tmp_path):
    old = make_site(tmp_path / "old", version="0.1.0")
    out = run_script(old, "import json, fakefw.trainer as T; print(json.dumps(T.Trainer().step(1)))",
                     env={"GRPO_PATCHES": "fakefw"})
    assert out["out"] == 2
    assert "fakefw 0.1.0 is outside the supported range >=1.0,<2" in out["stderr"]


def test_startup_module_runs_once_even_if_the_pth_is_read_twice(fake_site):
    # venvs expose site-packages twice (lib and lib64): the second read must be a no-op
    code = "import json, grpo_patches._startup as s, importlib; print(json.dumps(1))"
    out = run_script(fake_site, code, env={"GRPO_PATCHES": "fakefw,bogus"})
    assert out["stderr"].count("GrpoPatchesWarning") == 1


def test_run_parses_lists_and_off_values(fake_site, monkeypatch):
    from grpo_patches import _startup

    assert _startup.run({"GRPO_PATCHES": "off"}) == []
    assert _startup.run({}) == []
    monkeypatch.syspath_prepend(str(fake_site))
    assert _startup.run({"GRPO_PATCHES": " fakefw , ", "GRPO_PATCHES_OPTIONS": "tile_size=3"}) == ["fakefw"]
    assert grpo_patches.status()["fakefw"]["options"]["tile_size"] == 3
    grpo_patches.disable()


def test_importing_the_core_imports_no_framework_and_no_torch(fake_site):
    code = ("import json, sys, grpo_patches; grpo_patches.status(); "
            "print(json.dumps(sorted(m for m in ('torch', 'trl', 'transformers', 'verl', 'nemo_rl') if m in sys.modules)))")
    assert run_script(fake_site, code)["out"] == []


def test_adapters_install_only_as_a_subpackage(tmp_path):
    import subprocess

    code = ("import importlib.util, json, grpo_patches.adapters.trl as t; "
            "print(json.dumps([t.ADAPTER.name, importlib.util.find_spec('adapters') is None]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    # no top-level "adapters" (it would shadow the PyPI package of that name)
    assert proc.stdout.strip() == '["trl", true]'
