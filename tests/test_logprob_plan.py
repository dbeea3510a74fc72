"""plan_logprob_passes: which reference / old log-prob passes are skipped, and the reasons."""

from __future__ import annotations

import math

import pytest

from grpo_patches.errors import OptionError
from grpo_patches.logprob_plan import LogprobPassPlan, plan_logprob_passes
from grpo_patches.plugins import hook


def plan(kl=None, metrics=False, stepped=False, sampling=False) -> LogprobPassPlan:
    return plan_logprob_passes(
        kl_coefficients={"beta": 0.0} if kl is None else kl,
        kl_metrics_requested=metrics,
        optimizer_step_before_consumption=stepped,
        importance_sampling=sampling,
    )


def test_zero_beta_on_policy_skips_both_with_reasons():
    result = plan()
    assert result.skip_reference and result.skip_old
    assert result.skipped == ("reference", "old")
    assert result.reference_reason == "beta=0.0 and no KL metric requested"
    assert "on-policy" in result.old_reason


@pytest.mark.parametrize("kl", [{"beta": 0.04}, {"kl_loss_coef": 0.0, "kl_ctrl.kl_coef": 1e-300}])
def test_any_nonzero_coefficient_keeps_reference(kl):
    result = plan(kl)
    assert not result.skip_reference and result.skipped == ("old",)
    name, value = next((n, v) for n, v in kl.items() if v != 0)
    assert f"{name}={value!r}" in result.reference_reason


def test_every_coefficient_zero_skips_reference_and_names_them():
    result = plan({"kl_loss_coef": 0.0, "kl_ctrl.kl_coef": 0.0})
    assert result.skip_reference
    assert result.reference_reason == "kl_loss_coef=0.0, kl_ctrl.kl_coef=0.0 and no KL metric requested"


def test_empty_mapping_means_no_kl_term():
    result = plan({})
    assert result.skip_reference and "no KL coefficient" in result.reference_reason


def test_kl_metric_request_keeps_reference():
    result = plan({"beta": 0.0}, metrics=True)
    assert not result.skip_reference
    assert "beta=0.0" in result.reference_reason and "KL metric was requested" in result.reference_reason


@pytest.mark.parametrize(
    ("stepped", "sampling", "words"),
    [(True, False, "optimizer step"), (False, True, "importance-sampling"), (True, True, "optimizer step")],
)
def test_old_pass_runs_off_policy_or_with_importance_sampling(stepped, sampling, words):
    result = plan(stepped=stepped, sampling=sampling)
    assert not result.skip_old and result.skipped == ("reference",)
    assert words in result.old_reason
    if stepped and sampling:
        assert "importance-sampling" in result.old_reason


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf, -math.inf])
def test_bad_coefficient_is_a_clear_error(bad):
    with pytest.raises(ValueError, match=r"'beta'.*finite and >= 0"):
        plan({"beta": bad})


@pytest.mark.parametrize("bad", ["0", None, True, [0.0]])
def test_non_numeric_coefficient_is_rejected(bad):
    with pytest.raises(OptionError, match="'kl_loss_coef' must be a number"):
        plan({"kl_loss_coef": bad})


def test_non_mapping_and_non_bool_flags_are_rejected():
    with pytest.raises(OptionError, match="kl_coefficients must be a mapping"):
        plan([("beta", 0.0)])  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="importance_sampling must be True or False"):
        plan(sampling=1)  # type: ignore[arg-type]


def test_numpy_like_scalars_are_accepted():
    class Scalar:  # e.g. a numpy float or a 0-d tensor: only __float__
        def __float__(self) -> float:
            return 0.0

    assert plan({"beta": Scalar()}).skip_reference


def test_plan_is_frozen():
    with pytest.raises(AttributeError):
        plan().skip_old = False  # type: ignore[misc]


def test_through_the_plugin_hook():
    result = hook().grpo_plan_logprob_passes(
        framework="trl",
        kl_coefficients={"beta": 0.0},
        kl_metrics_requested=False,
        optimizer_step_before_consumption=True,
        importance_sampling=False,
    )
    assert isinstance(result, LogprobPassPlan) and result.skipped == ("reference",)
