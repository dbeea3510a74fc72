"""decide_reference_pass: is the reference pass skipped, and why; the old pass's reasons."""

from __future__ import annotations

import dataclasses
import math

import pytest

from grpo_patches.errors import OptionError
from grpo_patches.plugins import hook
from grpo_patches.recompute import explain
from grpo_patches.reference_pass import ReferencePassDecision, decide_reference_pass


def decide(kl=None, metrics=False) -> ReferencePassDecision:
    return decide_reference_pass(kl_coefficients={"beta": 0.0} if kl is None else kl, kl_metrics_requested=metrics)


def test_zero_beta_skips_with_a_reason():
    result = decide()
    assert result.skip
    assert result.reason == "beta=0.0 and no KL metric requested"


@pytest.mark.parametrize("kl", [{"beta": 0.04}, {"kl_loss_coef": 0.0, "kl_ctrl.kl_coef": 1e-300}])
def test_any_nonzero_coefficient_keeps_reference(kl):
    result = decide(kl)
    assert not result.skip
    name, value = next((n, v) for n, v in kl.items() if v != 0)
    assert f"{name}={value!r}" in result.reason


def test_every_coefficient_zero_skips_reference_and_names_them():
    result = decide({"kl_loss_coef": 0.0, "kl_ctrl.kl_coef": 0.0})
    assert result.skip
    assert result.reason == "kl_loss_coef=0.0, kl_ctrl.kl_coef=0.0 and no KL metric requested"


def test_empty_mapping_means_no_kl_term():
    result = decide({})
    assert result.skip and "no KL coefficient" in result.reason


def test_kl_metric_request_keeps_reference():
    result = decide({"beta": 0.0}, metrics=True)
    assert not result.skip
    assert "beta=0.0" in result.reason and "KL metric was requested" in result.reason


@pytest.mark.parametrize(
    ("consumptions", "window", "elsewhere", "compute", "words"),
    [
        (2, 1, False, True, "optimizer step"),
        (1, 1, True, True, "importance sampling"),
        (1, 2, False, False, "on-policy"),
        (1, 2, False, True, "plugin decided"),  # a plugin forced a pass the rule would skip
        (3, 1, False, False, "plugin decided"),
    ],
)
def test_old_pass_reasons_follow_the_decision_taken(consumptions, window, elsewhere, compute, words):
    reason = explain(compute, consumptions, window, elsewhere)
    assert reason.startswith("computed" if compute else "skipped") and words in reason


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf, -math.inf])
def test_bad_coefficient_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=r"'beta'.*finite and >= 0"):
        decide({"beta": bad})


@pytest.mark.parametrize("bad", ["0", None, True, [0.0]])
def test_non_numeric_coefficient_is_rejected(bad):
    with pytest.raises(OptionError, match="'kl_loss_coef' must be a number"):
        decide({"kl_loss_coef": bad})


def test_non_mapping_and_non_bool_flags_are_rejected():
    with pytest.raises(OptionError, match="kl_coefficients must be a mapping"):
        decide([("beta", 0.0)])  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="kl_metrics_requested must be True or False"):
        decide(metrics=1)  # type: ignore[arg-type]


def test_numpy_like_scalars_are_accepted():
    class Scalar:  # e.g. a numpy float or a 0-d tensor: only __float__
        def __float__(self) -> float:
            return 0.0

    assert decide({"beta": Scalar()}).skip


def test_decision_is_a_value_nobody_can_change():
    """Adapters keep the hook's decision (status notes, per-step checks): it compares by value
    and a holder cannot change it in place."""
    first, again = decide(), decide()
    assert first == again and first is not again and hash(first) == hash(again)
    assert decide({"beta": 0.1}) != first
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.skip = False  # type: ignore[misc]
    assert first.skip


def test_through_the_plugin_hook():
    result = hook().grpo_skip_reference_pass(framework="trl", kl_coefficients={"beta": 0.0}, kl_metrics_requested=False)
    assert isinstance(result, ReferencePassDecision) and result.skip
