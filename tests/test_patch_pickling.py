"""Patch proxies of records with ``pickle_by_reference``: they pickle as the attribute they stand at.

Ray ships a ``@ray.remote`` class by value, and with it the functions its methods call by a
module name, pickled by reference and looked up again in the worker (NeMo-RL's DTensor
policy worker: ``get_microbatch_iterator`` imported by name into the worker module). A
process that receives a reference gets its own attribute: patched there, or the original.
"""

from __future__ import annotations

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
