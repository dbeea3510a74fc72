"""Patch proxies of records with ``pickle_by_reference``: they pickle as the attribute they stand at.

Ray ships a ``@ray.remote`` class by value, and with it the functions its methods call by a
module name, pickled by reference and looked up again in the worker (NeMo-RL's DTensor
policy worker: ``get_microbatch_iterator`` imported by name into the worker module). A
process that receives a reference gets its own attribute: patched there, or the original.
"""

from __future__ import annotations

import importlib
import pickle
import sys
import textwrap
import types

import pytest
import wrapt
from packaging.version import Version

from grpo_patches.patching import PatchTarget, ReferenceProxy, apply_targets, restore_all


@pytest.fixture()
def modules(tmp_path, monkeypatch):
    """``fakesrc.data.helper`` imported by name into ``fakesrc.worker``."""
    pkg = tmp_path / "fakesrc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "data.py").write_text("def helper(x):\n    return ('helper', x)\n")
    (pkg / "worker.py").write_text(textwrap.dedent("""
        from fakesrc.data import helper

        def train(x):
            return helper(x)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import fakesrc.worker

    yield fakesrc.worker
    for name in [m for m in sys.modules if m.startswith("fakesrc")]:
        del sys.modules[name]


def _tagging(wrapped, instance, args, kwargs):
    return ("patched", wrapped(*args, **kwargs))


def _apply(by_reference: bool):
    target = PatchTarget("fakesrc.worker", "helper", _tagging, pickle_by_reference=by_reference)
    return apply_targets("fake", Version("1.0"), ">=1", [target])


def test_pickles_as_the_attribute_it_stands_at(modules):
    applied = _apply(True)
    try:
        proxy = modules.helper
        assert isinstance(proxy, ReferenceProxy) and modules.train(1) == ("patched", ("helper", 1))
        assert not isinstance(proxy, types.FunctionType)  # else cloudpickle ships the wrapped function by value
        assert pickle.loads(pickle.dumps(proxy)) is proxy  # this process: its own (patched) attribute
    finally:
        restore_all(applied)
    blob = None
    applied = _apply(True)
    try:
        blob = pickle.dumps(modules.helper)
    finally:
        restore_all(applied)
    assert pickle.loads(blob) is modules.helper  # a process without the patch: the original
    assert b"fakesrc.worker" in blob and b"grpo_patches" not in blob  # the receiver needs no grpo_patches


def test_plain_proxies_still_refuse_to_pickle(modules):
    applied = _apply(False)
    try:
        assert isinstance(modules.helper, wrapt.FunctionWrapper) and not isinstance(modules.helper, ReferenceProxy)
        with pytest.raises(NotImplementedError):
            pickle.dumps(modules.helper)
    finally:
        restore_all(applied)


def test_only_for_module_level_attributes():
    with pytest.raises(ValueError, match="module-level"):
        PatchTarget("m", "Class.method", _tagging, pickle_by_reference=True)


def _cloudpickle():
    for name in ("cloudpickle", "ray.cloudpickle"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    pytest.skip("not run: neither cloudpickle nor ray (the ray-startup and NeMo-RL compat sessions have ray)")


RECEIVER = """
import pickle, sys
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "patched":
    from grpo_patches.patching import PatchTarget, apply_targets
    from packaging.version import Version
    import fakesrc.worker
    apply_targets("fake", Version("1.0"), ">=1", [PatchTarget("fakesrc.worker", "helper",
                  lambda w, i, a, k: ("patched", w(*a, **k)), pickle_by_reference=True)])
actor = pickle.loads(open(sys.argv[3], "rb").read())
print(actor().train(2))
"""


def test_a_ray_shipped_class_calls_the_receivers_attribute(modules, tmp_path):
    """As Ray ships an actor class: by value, its methods copied at decoration (tracing wrappers),
    their module names looked up again in the receiving process."""
    import subprocess

    cloudpickle = _cloudpickle()
    source = modules.__file__.rsplit("/fakesrc/", 1)[0]
    (tmp_path / "fakesrc" / "actor.py").write_text(textwrap.dedent("""
        from fakesrc.worker import helper


        def nvtx(func):  # NeMo-RL's @wrap_with_nvtx_name: a local wrapper, so shipped by value
            def wrapper(*args, **kwargs):
                return func(*args, **kwargs)
            return wrapper


        class Impl:
            @nvtx
            def train(self, x):
                return helper(x)


        def remote(cls):  # Ray's modified class: each method copied in at decoration
            method = cls.train
            return type(cls.__name__, (cls,), {"train": lambda self, *a, **k: method(self, *a, **k)})
    """))
    import fakesrc.actor as actor_module

    applied = _apply(True)
    try:
        # patched after the module's import, as grpo_patches' start-up hooks do: the copied method
        # keeps the original function; the name it calls is what must reach the receiver patched
        actor_module.helper = modules.helper  # the by-name import, rebound as an import after patching would
        blob = tmp_path / "actor.pkl"
        blob.write_bytes(cloudpickle.dumps(actor_module.remote(actor_module.Impl)))
    finally:
        restore_all(applied)
    script = tmp_path / "receive.py"
    script.write_text(RECEIVER)
    out = {mode: subprocess.run([sys.executable, str(script), source, mode, str(blob)], capture_output=True,
                                text=True, check=True).stdout.strip() for mode in ("patched", "plain")}
    assert out == {"patched": "('patched', ('helper', 2))", "plain": "('helper', 2)"}
