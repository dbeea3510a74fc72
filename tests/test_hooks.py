"""Hook plumbing: specs, trylast defaults that user plugins override, entry-point plugins."""

from __future__ import annotations

import pytest

import grpo_patches
from grpo_patches import hookspecs, savings
from grpo_patches.plugins import hook
from tests.helpers.fakefw_site import make_site, run_script


def test_every_spec_is_prefixed_documented_and_has_a_default():
    pm = grpo_patches.plugin_manager()
    specs = [name for name in dir(hookspecs) if name.startswith("grpo_")]
    assert len(specs) >= 5
    for name in specs:
        assert getattr(hookspecs, name).__doc__.strip(), name
        impls = getattr(pm.hook, name).get_hookimpls()
        assert any(i.plugin_name == "grpo_patches.defaults" and i.trylast for i in impls), name


class AlwaysRecompute:
    @grpo_patches.hookimpl
    def grpo_recompute_old_logps(self, framework, consumptions_left, window_steps_left, needed_elsewhere):
        return True


class Defer:
    @grpo_patches.hookimpl
    def grpo_recompute_old_logps(self, framework, consumptions_left, window_steps_left, needed_elsewhere):
        return None


@pytest.fixture
def register():
    pm = grpo_patches.plugin_manager()
    added = []

    def _register(plugin):
        pm.register(plugin)
        added.append(plugin)

    yield _register
    for plugin in added:
        pm.unregister(plugin)


def test_a_user_plugin_overrides_the_default_decision(register):
    ask = dict(framework="trl", consumptions_left=2, window_steps_left=3, needed_elsewhere=False)
    assert hook().grpo_recompute_old_logps(**ask) is False  # default: both consumptions in the window
    register(Defer())
    assert hook().grpo_recompute_old_logps(**ask) is False  # None defers to the default
    register(AlwaysRecompute())
    assert hook().grpo_recompute_old_logps(**ask) is True


def test_savings_observers_all_see_reports_and_totals_accumulate(register):
    seen = []

    class Observer:
        @grpo_patches.hookimpl
        def grpo_report_savings(self, framework, savings):
            seen.append((framework, dict(savings)))

    register(Observer())
    savings.reset("demo")
    savings.report("demo", rows_dropped=3)
    savings.report("demo", rows_dropped=2, tokens_dropped=40)
    assert savings.totals("demo") == {"rows_dropped": 5, "tokens_dropped": 40}
    assert seen == [("demo", {"rows_dropped": 3}), ("demo", {"rows_dropped": 2, "tokens_dropped": 40})]
    savings.reset("demo")


ASK = (
    "import json; from grpo_patches.plugins import hook; "
    "print(json.dumps(hook().grpo_recompute_old_logps(framework='x', consumptions_left=1, "
    "window_steps_left=1, needed_elsewhere=False)))"
)


def test_entry_point_plugins_load_unless_disabled(tmp_path):
    site = make_site(tmp_path, plugin=True)
    assert run_script(site, ASK)["out"] is True
    assert run_script(site, ASK, env={"GRPO_PATCHES_DISABLE_PLUGIN_AUTOLOAD": "1"})["out"] is False
