"""Warnings raised inside a patched method name the caller's frame, as without the patch."""

from __future__ import annotations

import inspect
import sys
import types
import warnings

import pytest
from packaging.version import Version

from grpo_patches.patching import PatchTarget, apply_targets, restore_all

MODULE = "grpo_patches_test_warning_fw"


class Framework:
    def method(self, x, scale=2):
        warnings.warn("deprecated argument", FutureWarning, stacklevel=2)
        return x * scale


# the adapter's wrapper lives in another module (as in the real adapters): a warning named
# after its frame would carry that module's name and escape the caller's module filters
_adapter = types.ModuleType("grpo_patches_test_adapter")
exec("def passthrough(wrapped, instance, args, kwargs):\n    return wrapped(*args, **kwargs)\n", _adapter.__dict__)
passthrough = _adapter.passthrough


def bound_arguments(wrapped, instance, args, kwargs):
    return dict(inspect.signature(wrapped).bind(*args, **kwargs).arguments)


@pytest.fixture
def framework_module():
    module = types.ModuleType(MODULE)
    module.Framework = type("Framework", (Framework,), {"method": Framework.method})
    sys.modules[MODULE] = module
    yield module
    del sys.modules[MODULE]


def patch(module, *wrappers):
    targets = [PatchTarget(MODULE, "Framework.method", w) for w in wrappers]
    return apply_targets("fw", Version("1.0"), ">=1", targets)


def call_and_catch(obj):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        result = obj.method(3)
    return result, line, caught


@pytest.mark.parametrize("stacked", [1, 2])
def test_framework_warning_names_the_callers_file_and_line(framework_module, stacked):
    applied = patch(framework_module, *[passthrough] * stacked)
    try:
        result, line, caught = call_and_catch(framework_module.Framework())
    finally:
        restore_all(applied)
    assert result == 6
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]


def test_a_module_filter_of_the_caller_still_matches(framework_module):
    applied = patch(framework_module, passthrough)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", category=FutureWarning, module=__name__)
            with pytest.raises(FutureWarning):
                framework_module.Framework().method(1)
    finally:
        restore_all(applied)


def test_wrappers_still_see_the_originals_signature(framework_module):
    applied = patch(framework_module, bound_arguments)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert framework_module.Framework().method(3, scale=5) == {"x": 3, "scale": 5}
    finally:
        restore_all(applied)
