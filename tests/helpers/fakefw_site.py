"""A test-only fake framework ``fakefw``, installed into a temporary site directory.

It has a real ``.dist-info`` (so version checks read it like any framework's), an adapter
declared through the ``grpo_patches.adapters`` entry-point group (so ``enable("fakefw")``
and ``GRPO_PATCHES=fakefw`` find it), and optionally a hook plugin entry point.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

FRAMEWORK = '''
"""fakefw: a framework with the shapes our patches meet (methods, static/class, inherited)."""
'''

WORKER = '''
"""A module only worker processes import (it never imports fakefw.trainer)."""


def work(x):
    return x * 10


def check(x):
    return x
'''

TRAINER = '''
def helper(x):
    return x * 2


class Trainer:
    def step(self, x):
        return x + 1

    @staticmethod
    def static(x):
        return x - 1

    @classmethod
    def klass(cls, x):
        return (cls.__name__, x)

    def inherited(self):
        return "base"


class SubTrainer(Trainer):
    pass
'''

ADAPTER = '''
"""Adapter for fakefw: every wrapper tags results so tests can see the patch."""

from grpo_patches.registry import Adapter
from grpo_patches.patching import PatchTarget
from grpo_patches import api


def _tag(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    options = api.active_options("fakefw")
    return ("patched", result, options.tile_size if options else None)


MISSING_ATTRIBUTE = {missing!r}
T, W = "fakefw.trainer", "fakefw.worker"

PATCHES = (
    PatchTarget(T, "Trainer.step", _tag),
    PatchTarget(T, "Trainer.static", _tag),
    PatchTarget(T, "Trainer.klass", _tag),
    PatchTarget(T, "SubTrainer.inherited", _tag),
    PatchTarget(T, "helper", _tag, option="tiled_loss"),
    PatchTarget(W, "work", "fakefw_adapter:_tag"),
    PatchTarget(W, "check", "fakefw_adapter:_tag", option="verify_every"),  # fakefw "has" verify mode
) + ((PatchTarget(T, MISSING_ATTRIBUTE, _tag),) if MISSING_ATTRIBUTE else ())  # a target that moved upstream

ADAPTER = Adapter(name="fakefw", distribution="fakefw", supported=">=1.0,<2", patches=PATCHES)
'''

PLUGIN = '''
"""A third-party hook plugin, loaded from the grpo_patches entry-point group."""

from grpo_patches import hookimpl


@hookimpl
def grpo_recompute_old_logps(framework, consumptions_left, window_steps_left, needed_elsewhere):
    return True  # the default answers False here: True says the plugin was loaded
'''


def make_site(root: Path, version: str = "1.2.0", plugin: bool = False, missing: str | None = None) -> Path:
    """Write fakefw ``version`` into ``root`` (a directory to put on ``sys.path``)."""
    root.mkdir(parents=True, exist_ok=True)
    pkg = root / "fakefw"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(FRAMEWORK))
    (pkg / "trainer.py").write_text(textwrap.dedent(TRAINER))
    (pkg / "worker.py").write_text(textwrap.dedent(WORKER))
    (root / "fakefw_adapter.py").write_text(ADAPTER.replace("{missing!r}", repr(missing)))
    dist = root / f"fakefw-{version}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakefw\nVersion: {version}\n")
    entry_points = "[grpo_patches.adapters]\nfakefw = fakefw_adapter:ADAPTER\n"
    if plugin:
        (root / "fakefw_plugin.py").write_text(PLUGIN)
        entry_points += "\n[grpo_patches]\nfakefw_plugin = fakefw_plugin\n"
    (dist / "entry_points.txt").write_text(entry_points)
    return root


def run_script(site, code: str, env: dict | None = None) -> dict:
    """Run ``code`` in a fresh interpreter with the fake site on the path; it prints JSON."""
    full_env = {**os.environ, "PYTHONPATH": str(site), **(env or {})}
    if not env or "GRPO_PATCHES" not in env:
        full_env.pop("GRPO_PATCHES", None)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return {"out": json.loads(proc.stdout.strip().splitlines()[-1]), "stderr": proc.stderr}
