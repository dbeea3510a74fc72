"""Each decision hook's answer is checked against its contract where an adapter receives it
(grpo_patches.hook_contracts): a broken answer is one HookContractError naming the plugin and the rule."""

from __future__ import annotations

import pytest
import torch

import grpo_patches
from grpo_patches import hook_contracts, plugins
from grpo_patches.errors import HookContractError
from grpo_patches.reference_pass import ReferencePassDecision
from grpo_patches.zero_advantage import ZeroAdvantageFilter, filter_zero_advantage
from tests.helpers.faulty_plugins import DropsANonZeroRow, past_the_contract

ADVANTAGES = torch.tensor([0.5, 0.0, -0.5, 0.0])
MASK = torch.ones(4, 3)
FILTER = dict(advantages=ADVANTAGES, mask=MASK, denominator="tokens", group=None)


class Answers:
    """A plugin answering every decision hook with what it is given."""

    def __init__(self, **answers) -> None:
        self.answers = answers

    @grpo_patches.hookimpl
    def grpo_filter_zero_advantage(self, advantages, mask, denominator, group):
        return self.answers.get("filter")

    @grpo_patches.hookimpl
    def grpo_recompute_old_logps(self):
        return self.answers.get("recompute")

    @grpo_patches.hookimpl
    def grpo_skip_reference_pass(self):
        return self.answers.get("reference")

    @grpo_patches.hookimpl
    def grpo_lm_head_token_stats(self, labels):
        return self.answers.get("token_stats")


@pytest.fixture
def registered():
    pm, names = plugins.plugin_manager(), []

    def register(plugin, name="planted"):
        pm.register(plugin, name=name)
        names.append(name)
        return plugins.hook()

    yield register
    for name in names:
        pm.unregister(name=name)


def _plan(keep, weights):
    return ZeroAdvantageFilter(torch.tensor(keep, dtype=torch.long), torch.tensor(weights), 4 - len(keep), 0, 0, None)


@pytest.mark.parametrize(("answer", "rule"), [
    (_plan([0], [1.0]), r"dropped row\(s\) \[2\] whose advantage is not exactly 0"),
    (_plan([], []), "must keep at least one row"),
    (_plan([2, 0], [1.0, 1.0]), "ascending and without repeats"),
    (_plan([0, 4], [1.0, 1.0]), r"outside \[0, 4\)"),
    (_plan([0, 2], [1.0]), "one weight per kept row"),
    (_plan([0, 2], [1.0, -1.0]), "finite and >= 0"),
    ("all rows", "must return a ZeroAdvantageFilter"),
])
def test_a_broken_filter_answer_names_the_plugin_and_the_rule(registered, answer, rule):
    hook = registered(Answers(filter=answer), name="my-filter")
    with pytest.raises(HookContractError, match=rf"plugin 'my-filter': its grpo_filter_zero_advantage .*{rule}"):
        hook.grpo_filter_zero_advantage(**FILTER)


def test_the_default_plan_and_a_plan_keeping_more_rows_pass_the_contract(registered):
    assert plugins.hook().grpo_filter_zero_advantage(**FILTER).keep.tolist() == [0, 2]
    hook = registered(Answers(filter=_plan([0, 1, 2], [1.0, 0.0, 1.0])))  # a zero-advantage row kept at weight 0
    assert hook.grpo_filter_zero_advantage(**FILTER).keep.tolist() == [0, 1, 2]


def test_the_verify_tests_let_their_planted_fault_past_the_contract_and_no_further(registered):
    hook = registered(DropsANonZeroRow())
    with past_the_contract():
        assert hook.grpo_filter_zero_advantage(**FILTER).keep.tolist() == [2]
    with pytest.raises(HookContractError):
        hook.grpo_filter_zero_advantage(**FILTER)


def test_an_unnamed_plugin_is_named_by_its_class(registered):
    pm = plugins.plugin_manager()
    plugin = DropsANonZeroRow()
    pm.register(plugin)
    try:
        with pytest.raises(HookContractError, match=r"plugin 'tests.helpers.faulty_plugins.DropsANonZeroRow'"):
            plugins.hook().grpo_filter_zero_advantage(**FILTER)
    finally:
        pm.unregister(plugin)


class HostReads(torch.Tensor):
    """A tensor recording every call that reads it back to the host (ops on it return HostReads too)."""

    READS = frozenset({"cpu", "tolist", "numpy", "item", "__bool__", "__int__", "__float__", "__index__"})
    calls: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in cls.READS:
            cls.calls.append(func.__name__)
        return super().__torch_function__(func, types, args, kwargs or {})


def _check_filter_counting_host_reads(keep, weights):
    HostReads.calls = []
    plan = ZeroAdvantageFilter(torch.tensor(keep).as_subclass(HostReads),
                               torch.tensor(weights).as_subclass(HostReads), 4 - len(keep), 0, 0, None)
    kwargs = dict(FILTER, advantages=ADVANTAGES.as_subclass(HostReads), mask=MASK.as_subclass(HostReads))
    return hook_contracts.CONTRACTS["grpo_filter_zero_advantage"](plan, kwargs), HostReads.calls


def test_the_filter_check_reads_one_bool_back_per_micro_batch_and_copies_rows_only_to_name_them():
    assert _check_filter_counting_host_reads([0, 2], [1.0, 1.0]) == (None, ["__bool__"])  # the GPU syncs once
    broken, reads = _check_filter_counting_host_reads([0], [1.0])
    assert "dropped row(s) [2] whose advantage is not exactly 0" in broken
    assert {"cpu", "tolist"} <= set(reads)  # the counter sees host copies where they happen


@pytest.mark.parametrize(("hook_name", "answer", "kwargs", "rule"), [
    ("grpo_recompute_old_logps", 1, {}, "True, False or None"),
    ("grpo_skip_reference_pass", True, {}, "a ReferencePassDecision or None"),
    ("grpo_lm_head_token_stats", (torch.zeros(2, 3), torch.zeros(2, 2)), {"labels": torch.zeros(2, 3)},
     r"shaped like labels \(2, 3\)"),
])
def test_the_other_decisions_are_checked_too(registered, hook_name, answer, kwargs, rule):
    key = {"grpo_recompute_old_logps": "recompute", "grpo_skip_reference_pass": "reference",
           "grpo_lm_head_token_stats": "token_stats"}[hook_name]
    hook = registered(Answers(**{key: answer}), name="wrong")
    call = getattr(hook, hook_name)
    spec_args = {name: kwargs.get(name) for name in call.spec.argnames}
    with pytest.raises(HookContractError, match=rf"plugin 'wrong'.*{rule}"):
        call(**spec_args)
    legal = {"recompute": True, "reference": ReferencePassDecision(True, "beta is 0"),
             "token_stats": (torch.zeros(2, 3), torch.zeros(2, 3))}[key]
    hook = registered(Answers(**{key: legal}), name="right")
    assert getattr(hook, hook_name)(**spec_args) is legal


def test_through_trl_a_plugin_that_drops_a_useful_row_stops_the_run_at_its_answer():
    pytest.importorskip("trl")
    from grpo_patches_testing.trl_train import train

    with pytest.raises(HookContractError, match=r"DropsANonZeroRow.*grpo_filter_zero_advantage.*not exactly 0"):
        train(True, {"zero_advantage_filter": True}, steps=1, plugins=[DropsANonZeroRow()], optim="sgd")
