"""The verl adapter's loss-mode table and gradient terms (no verl needed).

Each (line, loss_agg_mode) names what a micro-batch's loss is divided by; the filter's
exactness for each is checked in tests/test_zero_advantage.py (the framework CASES) and on
real verl in tests/test_verl_filter.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from packaging.version import Version

from grpo_patches.adapters.verl import ADAPTER
from grpo_patches.adapters.verl.loss_modes import (DENOMINATORS, LOSS_AGG_MODES, ROW_LOCAL_LOSS_MODES, denominator,
                                                   effective_agg_mode, gradient_terms, line_of, unsupported_settings)
from grpo_patches.errors import IncompatibleOptionsError, OptionError
from grpo_patches.zero_advantage import DENOMINATORS as CORE_DENOMINATORS
from grpo_patches.zero_advantage import require_filter_compatible


def test_every_line_maps_every_agg_mode_to_a_core_denominator():
    for line in ("legacy-0.6", "legacy", "engine"):
        for mode in LOSS_AGG_MODES:
            assert DENOMINATORS[(line, mode)] in CORE_DENOMINATORS
    assert {v for (line, _), v in DENOMINATORS.items() if line == "engine"} == {"fixed"}  # global counts
    assert denominator("legacy", "token-mean") == "tokens" and denominator("legacy-0.6", "seq-mean-token-sum-norm") == "fixed"
    with pytest.raises(OptionError, match="unknown verl loss_agg_mode 'token-sum'; valid ones are: token-mean"):
        denominator("engine", "token-sum")


def test_lines_follow_the_versions_and_the_table_covers_the_supported_range():
    assert [line_of(Version(v)) for v in ("0.6.1", "0.7.0", "0.7.1", "0.8.0", "0.9.1")] == [
        "legacy-0.6", "legacy", "legacy", "engine", "engine"]
    for v in ("0.6.1", "0.7.1", "0.8.0", "0.9.1"):
        modules = {t.module for t in ADAPTER.targets(Version(v))}
        legacy = Version(v) < Version("0.8")
        assert ("verl.workers.actor.dp_actor" in modules) is legacy
        assert ("verl.workers.engine.fsdp.transformer_impl" in modules) is not legacy


def config(**kw):
    base = dict(entropy_coeff=0.0, use_kl_loss=False, kl_loss_coef=0.001, loss_agg_mode="token-mean",
                policy_loss={"loss_mode": "vanilla"})
    return SimpleNamespace(**{**base, **kw})


def test_gradient_terms_name_verls_settings():
    require_filter_compatible(gradient_terms(config()))  # kl_loss_coef without use_kl_loss: no KL term
    with pytest.raises(IncompatibleOptionsError, match=r"actor.kl_loss_coef == 0 \(got 0.001\): a KL loss"):
        require_filter_compatible(gradient_terms(config(use_kl_loss=True)))
    with pytest.raises(IncompatibleOptionsError, match=r"actor.entropy_coeff == 0 \(got 0.01\): an entropy bonus"):
        require_filter_compatible(gradient_terms(config(entropy_coeff=0.01)))


def test_loss_modes_that_are_not_row_local_are_refused():
    assert unsupported_settings(config()) == []
    for mode in ("kl_cov", "clip_cov", "geo_mean"):
        (problem,) = unsupported_settings(config(policy_loss={"loss_mode": mode}))
        assert f"loss_mode={mode!r} is not row-local" in problem
    assert effective_agg_mode(config(policy_loss={"loss_mode": "gspo"})) == "seq-mean-token-mean"
    assert "kl_cov" not in ROW_LOCAL_LOSS_MODES
