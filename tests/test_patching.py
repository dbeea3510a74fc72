"""enable/disable/status on the fake framework: exact restore, idempotence, clear errors.

Import orders run in subprocesses (fresh interpreters), like ddtrace's patch tests.
"""

from __future__ import annotations

import sys

import pytest

import grpo_patches
from grpo_patches import api
from grpo_patches.errors import OptionError, UnknownFrameworkError, UnsupportedFrameworkError
from tests.helpers.fakefw_site import make_site, run_script

ATTRS = ["step", "static", "klass"]


# Snippets composed into import/patch/unpatch orders.
STEPS = {
    "import": "import fakefw.trainer as T\nORIG = ORIG if ORIG is not None or ENABLED else dict(T.Trainer.__dict__)",
    "enable": "grpo_patches.enable('fakefw', tile_size=7); ENABLED = True",
    "disable": "grpo_patches.disable('fakefw')",
}
CHECK = """
import fakefw.trainer as T
raw = dict(T.Trainer.__dict__)
print(json.dumps({
    'patched': T.Trainer().step(1) == ('patched', 2, 7),
    'proxies': [isinstance(raw[k], wrapt.FunctionWrapper) for k in ATTRS],
    'identical': None if ORIG is None else [raw[k] is ORIG[k] for k in ATTRS],
    'inherited_own': 'inherited' in T.SubTrainer.__dict__,
    'status_patched': grpo_patches.status()['fakefw']['patched'],
}))
"""

ORDERS = [
    (["import", "enable"], True),
    (["enable", "import"], True),
    (["import", "enable", "disable"], False),
    (["enable", "import", "disable"], False),
    (["enable", "disable", "import"], False),
    (["enable", "enable", "import", "disable", "disable"], False),
    (["import", "enable", "disable", "enable"], True),
    (["enable", "disable", "enable", "import"], True),
    (["import", "disable", "enable", "enable"], True),
]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return make_site(tmp_path_factory.mktemp("site"))


@pytest.mark.parametrize("order,expect_patched", ORDERS, ids=["-".join(o) for o, _ in ORDERS])
def test_import_orders(site, order, expect_patched):
    head = f"import json, wrapt, grpo_patches\nATTRS = {ATTRS!r}\nORIG = None\nENABLED = False"
    script = "\n".join([head, *(STEPS[s] for s in order)]) + CHECK
    result = run_script(site, script)["out"]
    assert result["patched"] is expect_patched
    assert result["status_patched"] is expect_patched
    assert result["proxies"] == [expect_patched] * len(ATTRS)
    assert result["inherited_own"] is expect_patched  # an inherited method is patched on the subclass only
    if result["identical"] is not None:  # originals captured before any patch: restored exactly
        assert result["identical"] == [not expect_patched] * len(ATTRS)


@pytest.fixture(autouse=True)
def _clean_state():
    """Each test starts with nothing enabled and no fake framework module loaded."""
    yield
    grpo_patches.disable()
    for name in [m for m in sys.modules if m.startswith("fakefw")]:
        del sys.modules[name]


@pytest.fixture
def fakefw(site, monkeypatch):
    """The fake framework imported in this process."""
    monkeypatch.syspath_prepend(str(site))
    import fakefw.trainer as trainer

    return trainer


def test_enable_patches_every_kind_of_attribute_and_disable_restores_identity(fakefw):
    originals = {k: fakefw.Trainer.__dict__[k] for k in ATTRS}
    helper = fakefw.helper
    grpo_patches.enable("fakefw", tiled_loss=True, tile_size=3)
    t = fakefw.Trainer()
    assert t.step(1) == ("patched", 2, 3)
    assert fakefw.Trainer.static(1) == ("patched", 0, 3)
    assert fakefw.SubTrainer.klass(1) == ("patched", ("SubTrainer", 1), 3)
    assert fakefw.SubTrainer().inherited() == ("patched", "base", 3)
    assert fakefw.helper(2) == ("patched", 4, 3)
    grpo_patches.disable("fakefw")
    for k in ATTRS:
        assert fakefw.Trainer.__dict__[k] is originals[k]
    assert "inherited" not in fakefw.SubTrainer.__dict__
    assert fakefw.helper is helper
    assert t.step(1) == 2


def test_enable_is_idempotent_and_new_options_reapply(fakefw):
    grpo_patches.enable("fakefw", tile_size=3)
    first = fakefw.Trainer.__dict__["step"]
    grpo_patches.enable("fakefw", tile_size=3)
    assert fakefw.Trainer.__dict__["step"] is first  # same options: nothing re-applied
    grpo_patches.enable("fakefw", tile_size=5)
    assert fakefw.Trainer().step(1) == ("patched", 2, 5)
    assert fakefw.Trainer.step.__wrapped__ is not fakefw.Trainer.__dict__["step"]  # not wrapped twice
    assert fakefw.helper(1) == 2  # gated by tiled_loss, off by default


def test_status_reports_version_options_and_targets(fakefw):
    assert grpo_patches.status()["fakefw"]["patched"] is False
    grpo_patches.enable("fakefw")
    entry = grpo_patches.status()["fakefw"]
    assert entry["installed"] == "1.2.0" and entry["supported"] and entry["patched"]
    assert entry["options"]["recompute"] is True
    assert "fakefw.trainer:Trainer.step" in entry["targets"]
    api.note("fakefw", "why", "something switched off")
    assert grpo_patches.status()["fakefw"]["notes"] == {"why": "something switched off"}


def test_version_outside_range_is_one_clear_error(tmp_path, monkeypatch):
    site = make_site(tmp_path / "old", version="0.9.0")
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(UnsupportedFrameworkError) as err:
        grpo_patches.enable("fakefw")
    msg = str(err.value)
    assert "fakefw 0.9.0" in msg and ">=1.0,<2" in msg and "fakefw.trainer:Trainer.step" in msg
    assert grpo_patches.status()["fakefw"]["patched"] is False


def test_missing_target_is_an_error_and_nothing_is_half_applied(tmp_path, monkeypatch):
    site = make_site(tmp_path / "moved", missing="Trainer.moved_away")
    monkeypatch.syspath_prepend(str(site))
    import fakefw.trainer as trainer

    original = trainer.Trainer.__dict__["step"]
    with pytest.raises(UnsupportedFrameworkError, match=r"fakefw.trainer:Trainer.moved_away not found"):
        grpo_patches.enable("fakefw")
    assert trainer.Trainer.__dict__["step"] is original
    assert grpo_patches.status()["fakefw"]["patched"] is False


def test_bad_names_and_options_list_the_valid_ones():
    with pytest.raises(UnknownFrameworkError, match="valid names are: trl, verl, nemo_rl"):
        grpo_patches.enable("tlr")
    with pytest.raises(OptionError, match="valid options are: recompute, logprob_skip"):
        grpo_patches.enable("trl", recompte=False)
    with pytest.raises(OptionError, match="'zero_advantage_filter' must be one of"):
        grpo_patches.enable("trl", zero_advantage_filter="yes")
    with pytest.raises(OptionError, match="tile_size"):
        grpo_patches.enable("trl", tile_size=0)
    with pytest.raises(UnknownFrameworkError):
        grpo_patches.disable("tlr")


def test_declared_but_unimplemented_framework_is_refused(monkeypatch):
    import types

    from packaging.version import Version

    from grpo_patches import registry

    module = types.ModuleType("planned_adapter")
    module.ADAPTER = registry.Adapter(name="planned", distribution="planned", supported=">=0.7", patches=(),
                                      description="adapter not implemented yet (see the notes)")
    monkeypatch.setitem(sys.modules, "planned_adapter", module)
    monkeypatch.setitem(registry.BUILTIN, "planned", "planned_adapter")
    monkeypatch.setattr(registry.Adapter, "installed_version", lambda self: Version("0.7.1"))
    with pytest.raises(UnsupportedFrameworkError, match="planned 0.7.1: adapter not implemented yet"):
        grpo_patches.enable("planned")
    assert api.active_options("planned") is None  # refused before anything was enabled
    entry = grpo_patches.status()["planned"]
    assert entry["reason"].startswith("adapter not implemented yet")
    assert entry["supported"] is False and entry["patched"] is False and entry["options"] is None


def test_an_option_with_no_effect_is_accepted_and_status_says_what_it_does(monkeypatch):
    """One meaning per option: an adapter declares what an option does in its framework when it
    has no effect of its own (verl's and NeMo-RL's ``recompute``), and an option whose records
    exist for other versions only does not apply to this one; ``status()`` lists both."""
    import types

    from packaging.version import Version

    from grpo_patches import registry
    from grpo_patches.patching import PatchTarget

    framework = types.ModuleType("optfw")
    framework.step = lambda x: x + 1
    monkeypatch.setitem(sys.modules, "optfw", framework)

    def passthrough(wrapped, instance, args, kwargs):
        return wrapped(*args, **kwargs)

    module = types.ModuleType("optfw_adapter")
    module.ADAPTER = registry.Adapter(
        name="optfw", distribution="optfw", supported=">=1,<3",
        patches=(PatchTarget("optfw", "step", passthrough),
                 PatchTarget("optfw", "step", passthrough, versions=">=2", option="tiled_loss")),
        not_applicable={"recompute": "optfw computes no old log-probs; logprob_skip decides its passes"},
    )
    monkeypatch.setitem(sys.modules, "optfw_adapter", module)
    monkeypatch.setitem(registry.BUILTIN, "optfw", "optfw_adapter")
    monkeypatch.setattr(registry.Adapter, "installed_version",
                        lambda self: Version("1.5") if self.name == "optfw" else None)
    grpo_patches.enable("optfw", recompute=False, tiled_loss="auto")
    try:
        entry = grpo_patches.status()["optfw"]
        assert entry["patched"] and entry["options"]["recompute"] is False
        assert entry["not_applicable"] == ["recompute", "tiled_loss"]
        assert entry["notes"] == {
            "recompute": "not applicable: optfw computes no old log-probs; logprob_skip decides its passes",
            "tiled_loss": "off: tiled_loss needs optfw >=2; 1.5 is installed",
        }
        with pytest.raises(UnsupportedFrameworkError, match="tiled_loss needs optfw >=2; 1.5 is installed"):
            grpo_patches.enable("optfw", tiled_loss=True)
    finally:
        grpo_patches.disable("optfw")
    with pytest.raises(ValueError, match=r"not_applicable names \['tile_size'\]"):
        registry.Adapter(name="x", distribution="x", supported=">=1", patches=(), not_applicable={"tile_size": "?"})


@pytest.mark.parametrize("how", ["True", "auto", "via all"])
def test_refuse_or_note_is_one_policy_with_one_wording(fakefw, how):
    """``option=True`` refuses with the one error; ``"auto"`` (or ``enable("all")``) notes why
    the optimization is off, per class of the object it is about."""
    from grpo_patches.errors import IncompatibleOptionsError
    from grpo_patches.refuse_or_note import refuse_or_note

    if how == "via all":
        grpo_patches.enable("all", zero_advantage_filter=True)
    else:
        grpo_patches.enable("fakefw", zero_advantage_filter=True if how == "True" else "auto")
    reasons = ["the zero-advantage filter needs beta == 0 (got 0.1): a KL term. Set beta=0", "an entropy bonus"]
    owner = fakefw.Trainer()
    if how == "True":
        with pytest.raises(IncompatibleOptionsError) as info:
            refuse_or_note("fakefw", "zero_advantage_filter", reasons, owner=owner)
        assert str(info.value) == (
            "zero_advantage_filter=True: the zero-advantage filter needs beta == 0 (got 0.1): a KL term. Set beta=0; "
            "an entropy bonus. To train without it, pass zero_advantage_filter='auto' (off, with the reason in "
            "grpo_patches.status()) or zero_advantage_filter=False to grpo_patches.enable('fakefw', ...)"
        )
        assert "zero_advantage_filter" not in grpo_patches.status()["fakefw"]["by_class"].get("fakefw.trainer.Trainer", {})
        return
    assert refuse_or_note("fakefw", "zero_advantage_filter", reasons, owner=owner) is False
    notes = grpo_patches.status()["fakefw"]["by_class"]["fakefw.trainer.Trainer"]
    assert notes["zero_advantage_filter"] == "off: " + "; ".join(reasons)


def test_enable_all_only_touches_installed_supported_frameworks(fakefw):
    grpo_patches.enable("all", tile_size=2)
    report = grpo_patches.status()
    assert report["fakefw"]["patched"] and api.enabled_via_all("fakefw")
    assert not report["verl"]["patched"] and not report["nemo_rl"]["patched"]
    grpo_patches.disable()
    assert not grpo_patches.status()["fakefw"]["patched"]


def test_moved_target_found_at_deferred_import_fails_that_import(tmp_path):
    site = make_site(tmp_path / "moved", missing="Trainer.moved_away")
    code = """
import json, grpo_patches
grpo_patches.enable('fakefw')
try:
    import fakefw.trainer
    error = None
except Exception as exc:
    error = f'{type(exc).__name__}: {exc}'
print(json.dumps({'error': error, 'status': grpo_patches.status()['fakefw']}))
"""
    out = run_script(site, code)["out"]
    assert out["error"].startswith("UnsupportedFrameworkError: cannot patch fakefw 1.2.0")
    assert "fakefw.trainer:Trainer.moved_away not found" in out["error"]
    assert out["status"]["patched"] is False and out["status"]["pending_import"] is False


def test_two_records_on_one_attribute_stack_and_unwind_exactly():
    import types

    from packaging.version import Version

    from grpo_patches.patching import PatchTarget, apply_targets, restore_all

    module = types.ModuleType("stacked_mod")
    module.Thing = type("Thing", (), {"f": lambda self: "f"})
    original = module.Thing.__dict__["f"]
    sys.modules["stacked_mod"] = module
    try:
        outer = PatchTarget("stacked_mod", "Thing.f", lambda w, i, a, k: "outer(" + w(*a, **k) + ")", ">=1")
        inner = PatchTarget("stacked_mod", "Thing.f", lambda w, i, a, k: "inner(" + w(*a, **k) + ")", ">=1")
        applied = apply_targets("stacked", Version("1.0"), ">=1", [inner, outer])
        assert module.Thing().f() == "outer(inner(f))"
        restore_all(applied)
        assert module.Thing.__dict__["f"] is original
    finally:
        del sys.modules["stacked_mod"]


def test_every_record_but_verify_modes_own_passes_through_while_the_unpatched_computation_runs():
    """Verify mode's pass-through is record-level behaviour of the core: no adapter checks a flag."""
    import types

    from packaging.version import Version

    from grpo_patches import passthrough
    from grpo_patches.patching import PatchTarget, apply_targets, restore_all

    module = types.ModuleType("through_mod")
    module.Thing = type("Thing", (), {"f": lambda self: "f"})
    sys.modules["through_mod"] = module
    try:
        filt = PatchTarget("through_mod", "Thing.f", lambda w, i, a, k: "filter(" + w(*a, **k) + ")",
                           option="zero_advantage_filter")
        check = PatchTarget("through_mod", "Thing.f", lambda w, i, a, k: "verify(" + w(*a, **k) + ")",
                            option="verify_every")
        applied = apply_targets("through", Version("1.0"), ">=1", [filt, check])
        assert module.Thing().f() == "verify(filter(f))"
        with passthrough.unpatched("through"):
            assert passthrough.active("through") and not passthrough.active("other")
            assert module.Thing().f() == "verify(f)"  # the filter stands aside, verify mode watches
            with passthrough.unpatched("other"):
                assert module.Thing().f() == "verify(f)"  # nested: still this framework's
        with passthrough.unpatched("other"):
            assert module.Thing().f() == "verify(filter(f))"  # another framework's computation
        assert not passthrough.active("through")
        restore_all(applied)
    finally:
        del sys.modules["through_mod"]


def test_a_wrapper_named_by_string_is_looked_up_at_each_call(monkeypatch):
    """A planted fault (the module's function replaced after enable) is what runs."""
    import types

    from packaging.version import Version

    from grpo_patches.patching import PatchTarget, apply_targets, restore_all

    module = types.ModuleType("named_mod")
    module.Thing = type("Thing", (), {"f": lambda self: "f"})
    wrappers = types.ModuleType("named_wrappers")
    wrappers.wrap = lambda w, i, a, k: "good(" + w(*a, **k) + ")"
    monkeypatch.setitem(sys.modules, "named_mod", module)
    monkeypatch.setitem(sys.modules, "named_wrappers", wrappers)
    applied = apply_targets("named", Version("1.0"), ">=1", [PatchTarget("named_mod", "Thing.f", "named_wrappers:wrap")])
    assert module.Thing().f() == "good(f)"
    monkeypatch.setattr(wrappers, "wrap", lambda w, i, a, k: "planted(" + w(*a, **k) + ")")
    assert module.Thing().f() == "planted(f)"
    restore_all(applied)


def test_status_shows_each_attributes_stack_outermost_first(fakefw):
    grpo_patches.enable("fakefw", tiled_loss=True)
    stacks = grpo_patches.status()["fakefw"]["stacks"]
    assert set(stacks) >= {"fakefw.trainer:Trainer.step", "fakefw.trainer:helper"}
    assert all(isinstance(s, list) and s for s in stacks.values())
    assert any("(tiled_loss)" in w for w in stacks["fakefw.trainer:helper"])


def test_an_opt_in_optimization_an_adapter_lacks_is_an_error_or_a_note_never_a_no_op():
    from packaging.version import Version

    from grpo_patches import registry
    from grpo_patches.options import Options

    adapter = registry.Adapter(name="x", distribution="x", supported=">=1", patches=())
    assert adapter.select(Version("1.0"), Options())[1] == {}
    assert adapter.select(Version("1.0"), Options(pack_kept_rows="auto"))[1] == {
        "pack_kept_rows": "off: pack_kept_rows is not available for x yet"}
    with pytest.raises(UnsupportedFrameworkError, match="pack_kept_rows=False"):
        adapter.select(Version("1.0"), Options(pack_kept_rows=True))
