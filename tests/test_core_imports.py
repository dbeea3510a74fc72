"""The core never imports a framework: every module of ``grpo_patches`` except the demo
sub-package (which runs TRL) imports without trl, transformers or any other framework, and none
of them imports the demo (save the command line, which runs it) or the test kit
(``grpo_patches_testing``, a distribution of its own).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import grpo_patches

PACKAGE = Path(grpo_patches.__file__).resolve().parent
FRAMEWORKS = ("trl", "transformers", "accelerate", "datasets", "tokenizers", "verl", "nemo_rl", "nemo_automodel")
DEMO = "grpo_patches.demo"
TESTING = "grpo_patches_testing"  # the test kit: what the end-to-end tests and the benchmarks share
SIDE = (DEMO, TESTING)


def _side(name: str) -> bool:
    return any(name == s or name.startswith(s + ".") for s in SIDE)


def core_modules() -> list[str]:
    """Every module under grpo_patches/ outside the demo sub-package, and the adapters' patch
    tables (the registry imports them to list what each framework would patch)."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if not _side(name):
            names.append(name)
    import grpo_patches.adapters

    adapters = Path(list(grpo_patches.adapters.__path__)[0])
    names += [f"grpo_patches.adapters.{p.parent.name}" for p in sorted(adapters.glob("*/__init__.py"))]
    return names


IMPORT_EACH = """
import importlib, json, sys
frameworks = {frameworks!r}
seen = {{}}
for name in {modules!r}:
    importlib.import_module(name)
    new = sorted(m for m in sys.modules if m.split('.')[0] in frameworks and m.split('.')[0] not in seen)
    for m in new:
        seen.setdefault(m.split('.')[0], name)
import grpo_patches
grpo_patches.status()  # reads versions from metadata, imports nothing of a framework
for m in sorted(sys.modules):
    seen.setdefault(m.split('.')[0], 'status()') if m.split('.')[0] in frameworks else None
print(json.dumps({{'imported': seen, 'side': sorted(m for m in sys.modules if m.startswith({side!r}))}}))
"""


def test_importing_the_core_imports_no_framework():
    modules = core_modules()
    assert "grpo_patches.api" in modules and "grpo_patches.cli" in modules and "grpo_patches.adapters.trl" in modules
    assert not any(_side(m) for m in modules)
    code = IMPORT_EACH.format(frameworks=FRAMEWORKS, modules=modules, side=SIDE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPO_PATCHES")}  # no start-up patching
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["imported"] == {}, f"framework -> the core module that imported it: {out['imported']}"
    assert out["side"] == []  # the command line imports the demo's defaults only when it builds its parser


def test_only_the_command_line_refers_to_the_demo_and_nothing_to_testing():
    """Statically too: a lazy import inside a function would not show in the test above."""
    referring = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] == DEMO.split(".")[1]:
            continue  # the demo itself
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(_side(n) for n in names):
                referring.append((path.relative_to(PACKAGE).as_posix(), next(n for n in names if _side(n))))
    assert referring and {p for p, _ in referring} == {"cli.py"}, referring  # the command line runs the demo
    assert all(n == DEMO or n.startswith(DEMO + ".") for _, n in referring), referring  # and nothing imports the kit
