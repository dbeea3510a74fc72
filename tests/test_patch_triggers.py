"""Per-module triggers, per-record status, the lock order, and per-instance state.

Each record is applied when its own module is imported: a worker process that imports only
``fakefw.worker`` gets that record and never imports ``fakefw.trainer``.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest

import grpo_patches
from grpo_patches import instance_state
from tests.helpers.fakefw_site import make_site, run_script


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return make_site(tmp_path_factory.mktemp("triggers"))


@pytest.fixture(autouse=True)
def _clean_state():
    yield
    grpo_patches.disable()
    for name in [m for m in sys.modules if m.startswith("fakefw")]:
        del sys.modules[name]


WORKER_ONLY = """
import json, sys, grpo_patches
grpo_patches.enable('fakefw')
import fakefw.worker as W
entry = grpo_patches.status()['fakefw']
print(json.dumps({
    'work': W.work(2),
    'trainer_imported': 'fakefw.trainer' in sys.modules,
    'patched': entry['patched'], 'pending': entry['pending_import'],
    'states': {p['target']: p['state'] for p in entry['patches']},
    'process': entry['process'],
}))
"""


def test_a_record_is_applied_when_its_own_module_is_imported(site):
    out = run_script(site, WORKER_ONLY)["out"]
    assert out["work"] == ["patched", 20, None]
    assert out["trainer_imported"] is False  # patching never imports another module
    assert out["patched"] is True and out["pending"] is True  # the trainer's records wait for their module
    assert out["states"]["fakefw.worker:work"] == "applied"
    assert out["states"]["fakefw.trainer:Trainer.step"] == "pending import"
    assert out["states"]["fakefw.trainer:helper"] == "off (tiled_loss=False)"
    assert out["process"].startswith("pid ")


def test_status_reports_every_record_and_what_this_adapter_does_not_implement(site, monkeypatch):
    monkeypatch.syspath_prepend(str(site))
    import fakefw.trainer  # noqa: F401

    grpo_patches.enable("fakefw", tiled_loss=True)
    entry = grpo_patches.status()["fakefw"]
    states = {p["target"]: p["state"] for p in entry["patches"]}
    assert states["fakefw.trainer:helper"] == "applied" and states["fakefw.worker:work"] == "pending import"
    assert entry["not_applicable"] == []


def test_enable_while_another_thread_imports_does_not_deadlock(site, monkeypatch):
    """enable() must not hold the API lock while waiting for a module another thread is
    importing: that import's post-import hook takes the same lock."""
    slow = site / "fakefw" / "slowmod.py"
    slow.write_text("import time\ntime.sleep(0.5)\n\n\ndef value():\n    return 1\n")
    monkeypatch.syspath_prepend(str(site))
    from grpo_patches import registry
    from grpo_patches.patching import PatchTarget

    get = registry.get
    tag = get("fakefw").patches[0].wrapper
    slow_adapter = registry.Adapter("fakefw", "fakefw", ">=1.0,<2", (PatchTarget("fakefw.slowmod", "value", tag),))
    monkeypatch.setattr(registry, "get", lambda name: slow_adapter if name == "fakefw" else get(name))

    grpo_patches.enable("fakefw", tile_size=1)  # registers the post-import hook for fakefw.slowmod
    importer = threading.Thread(target=lambda: __import__("fakefw.slowmod"))
    importer.start()
    time.sleep(0.2)  # the import is under way: the module is in sys.modules, initialising
    done = threading.Event()

    def reenable():
        grpo_patches.enable("fakefw", tile_size=2)  # new options: re-applied while the import runs
        done.set()

    threading.Thread(target=reenable, daemon=True).start()
    importer.join(10)
    assert done.wait(10), "enable() deadlocked with the import's post-import hook"
    assert grpo_patches.status()["fakefw"]["patched"] is True
    assert sys.modules["fakefw.slowmod"].value() == ("patched", 1, 2)


def test_disable_clears_every_instance_state():
    class Trainer:
        pass

    a, b = Trainer(), Trainer()
    instance_state.state_of(a, "trl", dict)["seen"] = 1
    instance_state.state_of(b, "trl", dict)
    instance_state.state_of(b, "verl", list)
    assert instance_state.peek(a, "trl") == {"seen": 1}
    grpo_patches.disable("trl")  # not enabled: its leftover states still go
    assert instance_state.peek(a, "trl") is None and instance_state.peek(b, "trl") is None
    assert "_grpo_patches" not in vars(a)
    assert instance_state.peek(b, "verl") == []  # another framework's state stays
    grpo_patches.disable()
    assert "_grpo_patches" not in vars(b)


def test_notes_per_trainer_class_and_overriding_subclasses(site, monkeypatch):
    from grpo_patches import api
    from grpo_patches.patching import overriding_class

    monkeypatch.syspath_prepend(str(site))
    import fakefw.trainer as T

    class Custom(T.SubTrainer):
        def step(self, x):  # bypasses a wrapper on Trainer.step
            return x

    assert overriding_class(T.SubTrainer, T.Trainer, "step") is None
    assert overriding_class(Custom, T.Trainer, "step") is Custom
    grpo_patches.enable("fakefw")
    api.note("fakefw", "step", "off: Custom overrides Trainer.step", owner=Custom())
    api.note("fakefw", "step", "on", owner=T.Trainer)
    by_class = grpo_patches.status()["fakefw"]["by_class"]
    assert by_class[f"{__name__}.{Custom.__qualname__}"] == {"step": "off: Custom overrides Trainer.step"}
    assert by_class["fakefw.trainer.Trainer"] == {"step": "on"}
