"""Warnings raised inside a patched method name the caller's frame, as without the patch.

Only records that ask for it (``PatchTarget(caller_frame=True)``) pay for the trampoline; the
others' wrappers get the original itself.
"""

from __future__ import annotations

import inspect
import sys
import types
import warnings

import pytest
from packaging.version import Version

from grpo_patches.caller_frame import OriginalCall
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


def patch(module, *wrappers, caller_frame=True):
    targets = [PatchTarget(MODULE, "Framework.method", w, caller_frame=caller_frame) for w in wrappers]
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


def test_a_record_without_the_flag_calls_the_original_directly(framework_module):
    seen = []

    def record(wrapped, instance, args, kwargs):
        seen.append(wrapped)
        return wrapped(*args, **kwargs)

    applied = patch(framework_module, record, caller_frame=False)
    try:
        obj = framework_module.Framework()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert obj.method(3) == 6
    finally:
        restore_all(applied)
    assert not isinstance(seen[0], OriginalCall)  # no trampoline on this record's calls
    assert seen[0] == obj.method and seen[0].__func__ is Framework.method


def test_the_records_that_keep_the_callers_frame():
    """Exactly the methods that warn with ``stacklevel=2`` toward the user's code: TRL's
    ``GRPOTrainer.__init__`` (rollout_func, use_liger_kernel, ...), NeMo-RL's ``grpo_train`` /
    ``async_grpo_train`` (top-k checkpoint metric); every record on such an attribute has it."""
    from grpo_patches import registry

    flagged = set()
    for name in registry.BUILTIN:
        by_attribute: dict[str, set[bool]] = {}
        for target in registry.get(name).patches:
            by_attribute.setdefault(target.name, set()).add(target.caller_frame)
        assert all(len(flags) == 1 for flags in by_attribute.values()), name  # stacked records agree
        flagged |= {attribute for attribute, flags in by_attribute.items() if True in flags}
    assert flagged == {
        "trl.trainer.grpo_trainer:GRPOTrainer.__init__",
        "nemo_rl.algorithms.grpo:grpo_train",
        "nemo_rl.algorithms.grpo:async_grpo_train",
    }
