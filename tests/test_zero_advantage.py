"""Zero-advantage filter: loss and gradient with the filter equal those without (fp64, <= 1e-6).

A tiny linear "lm head" gives per-token log-probs, a GRPO clipped per-token loss, and each
framework's own aggregation (written out below from the framework's formula). The filtered run
aggregates only the kept rows, each kept row's per-token loss multiplied by its weight.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

import grpo_patches
from grpo_patches.errors import IncompatibleOptionsError, OptionError
from grpo_patches.plugins import hook
from grpo_patches.adapters.trl.loss_modes import denominator as trl_denominator
from grpo_patches.zero_advantage import (
    DENOMINATORS,
    GradientTerm,
    ZeroAdvantageFilter,
    filter_zero_advantage,
    require_filter_compatible,
)
from tests.helpers.zero_advantage_cases import (  # noqa: E402
    DTYPE, TOL, ROWS, CASES, make_model, loss_and_grads, max_rel_diff, tokens_of, BATCHES,
)


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("case", list(CASES))
def test_filter_reproduces_loss_and_gradient(model, case, batch_name):
    _, _, denominator, aggregate = CASES[case]
    batch, zero_rows, rows_dropped, padding = BATCHES[batch_name]
    filt = filter_zero_advantage(batch["advantages"], batch["mask"], denominator)
    assert (filt.rows_dropped, filt.padding_rows) == (rows_dropped, padding)
    kept_zero = [int(i) for i in filt.keep if i in zero_rows]
    assert filt.tokens_dropped == tokens_of(batch, zero_rows) - tokens_of(batch, kept_zero)
    assert filt.keep.dtype == torch.long and filt.weights.dtype == DTYPE
    assert max_rel_diff(loss_and_grads(model, batch, aggregate, filt), loss_and_grads(model, batch, aggregate)) <= TOL


@pytest.mark.parametrize("case", ["trl-bnpo", "trl-grpo", "verl07-token-mean", "trl-dapo"])
def test_a_wrong_weight_is_detected(model, case):
    """The comparison is sharp: 1e-4 off in the weights, or naive dropping, fails it."""
    _, _, denominator, aggregate = CASES[case]
    batch = BATCHES["mixed"][0]
    filt = filter_zero_advantage(batch["advantages"], batch["mask"], denominator)
    want = loss_and_grads(model, batch, aggregate)
    assert max_rel_diff(loss_and_grads(model, batch, aggregate, filt, filt.weights * (1 + 1e-4)), want) > 10 * TOL
    if filt.scale != 1.0:  # local denominators: dropping rows without weights changes the result
        naive = torch.ones_like(filt.weights)
        assert max_rel_diff(loss_and_grads(model, batch, aggregate, filt, naive), want) > 1e-2


def test_weights_and_scale_values():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]], dtype=DTYPE)
    adv = torch.tensor([0.0, 1.0, -0.0, -2.0], dtype=DTYPE)
    expect = {"tokens": 4 / 9, "rows": 0.5, "fixed": 1.0}
    assert set(expect) == set(DENOMINATORS)
    for denominator in DENOMINATORS:
        filt = filter_zero_advantage(adv, mask, denominator)
        assert filt.keep.tolist() == [1, 3] and filt.scale == pytest.approx(expect[denominator], abs=0)
        assert filt.weights.tolist() == [expect[denominator]] * 2
        assert (filt.rows_dropped, filt.tokens_dropped, filt.padding_rows, filt.rows_kept) == (2, 5, 0, 2)


def test_exact_zero_only_never_a_tolerance():
    """|A| = 2.4e-3 or 1e-300 from an 'identical rewards' group is kept; only 0.0 / -0.0 is dropped."""
    mask = torch.ones(4, 3)
    filt = filter_zero_advantage(torch.tensor([2.4e-3, 1e-300, 0.0, -0.0], dtype=DTYPE), mask, "tokens")
    assert filt.keep.tolist() == [0, 1]
    nan = filter_zero_advantage(torch.tensor([float("nan"), 0.0]), torch.ones(2, 3), "tokens")
    assert nan.keep.tolist() == [0]  # a NaN must still reach the loss
    assert nan.weights.dtype == torch.float32


def test_per_token_advantages_count_only_unmasked_tokens():
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([[0.0, 0.0, 5.0], [0.0, 0.3, 0.0], [0.0, 0.0, 0.0]])
    filt = filter_zero_advantage(adv, mask, "rows")
    assert filt.keep.tolist() == [1] and filt.weights.tolist() == [pytest.approx(1 / 3)]


def test_all_zero_keeps_the_shortest_row_at_weight_zero():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    filt = filter_zero_advantage(torch.zeros(3), mask, "tokens")
    assert filt.keep.tolist() == [1] and filt.weights.tolist() == [0.0] and filt.scale == 0.0
    assert (filt.rows_dropped, filt.tokens_dropped, filt.padding_rows) == (2, 5, 1)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(OptionError, match="unknown denominator 'mean'; valid ones are: tokens, rows, fixed"):
        filter_zero_advantage(torch.zeros(2), torch.ones(2, 3), "mean")
    with pytest.raises(ValueError, match="one advantage per row"):
        filter_zero_advantage(torch.zeros(3), torch.ones(2, 3), "tokens")
    with pytest.raises(ValueError, match="mask's shape"):
        filter_zero_advantage(torch.zeros(2, 4), torch.ones(2, 3), "tokens")
    with pytest.raises(ValueError, match="not initialised"):
        filter_zero_advantage(torch.zeros(2), torch.ones(2, 3), "tokens", group=object())


# --- framework modes ------------------------------------------------------------------


def _trl_loss_types_in_compute_loss() -> set[str]:
    """Every loss_type string that TRL's installed ``_compute_loss`` branches on (source text)."""
    spec = importlib.util.find_spec("trl")
    if spec is None or spec.origin is None:
        pytest.skip("trl is not installed")
    source = (Path(spec.origin).parent / "trainer" / "grpo_trainer.py").read_text()
    body = source[source.index("def _compute_loss(") :]
    body = body[: body.index("\n    def ", 1)]
    found: set[str] = set()
    for branch in re.findall(r"self\.loss_type\s*(?:==|!=|in)\s*(\[[^\]]*\]|\"[^\"]+\")", body):
        found.update(re.findall(r"\"([^\"]+)\"", branch))
    return found


def test_the_trl_table_covers_every_trl_loss_type():
    loss_types = _trl_loss_types_in_compute_loss()
    assert {"grpo", "bnpo", "dr_grpo"} <= loss_types  # in every supported TRL (0.20+); the scan works
    for loss_type in loss_types:
        assert trl_denominator(loss_type) in DENOMINATORS


def test_unknown_trl_loss_type():
    with pytest.raises(OptionError, match=r"unknown trl loss mode 'gspo'; valid ones are: grpo, .*vespo"):
        trl_denominator("gspo")


# --- settings that make the filter inexact -----------------------------------------------


def terms(**values):
    """GradientTerms as the TRL adapter describes its settings (beta, entropy, quantile ...)."""
    from types import SimpleNamespace

    from grpo_patches.adapters.trl.loss_modes import gradient_terms

    described = {t.setting: t for t in gradient_terms(SimpleNamespace(aux_loss_enabled=True, use_adaptive_entropy=False))}
    described["entropy_coeff"] = GradientTerm("entropy_coeff", 0.0, "an entropy bonus")  # verl's name
    described["kl_loss_coef"] = GradientTerm("kl_loss_coef", 0.0, "a KL loss")
    out = []
    for name, value in values.items():
        base = described.get(name, GradientTerm(name, 0.0))
        out.append(GradientTerm(name, value, base.term, base.neutral, base.why))
    return out


def test_require_filter_compatible_message():
    with pytest.raises(IncompatibleOptionsError) as info:
        require_filter_compatible(terms(beta=0.04))
    assert str(info.value) == (
        "the zero-advantage filter needs beta == 0 (got 0.04): a KL term gives zero-advantage rows a gradient. "
        "Set beta=0, or pass zero_advantage_filter=False (or 'auto') to grpo_patches.enable(...)"
    )


def test_require_filter_compatible_reports_every_offender():
    with pytest.raises(IncompatibleOptionsError) as info:
        require_filter_compatible(terms(entropy_coeff=0.01, kl_loss_coef=0.0, router_aux_loss_coef=1e-3, my_coef=2.0))
    text = str(info.value)
    assert "entropy_coeff == 0 (got 0.01): an entropy bonus" in text
    assert "router_aux_loss_coef == 0 (got 0.001): a router aux loss" in text
    assert "my_coef == 0 (got 2.0): the term weighted by my_coef" in text and "kl_loss_coef" not in text
    with pytest.raises(IncompatibleOptionsError, match=r"top_entropy_quantile == 1 \(got 0.2\)"):
        require_filter_compatible(terms(top_entropy_quantile=0.2))
    with pytest.raises(IncompatibleOptionsError, match=r"beta == 0 \(got nan\)"):
        require_filter_compatible(terms(beta=float("nan")))
    with pytest.raises(OptionError, match="beta must be a number"):
        require_filter_compatible(terms(beta="0"))
    require_filter_compatible(terms(beta=0.0, entropy_coef=-0.0, top_entropy_quantile=1.0))


# --- plugin manager ---------------------------------------------------------------------


def test_default_through_the_plugin_hook():
    batch = BATCHES["mixed"][0]
    filt = hook().grpo_filter_zero_advantage(
        advantages=batch["advantages"], mask=batch["mask"], denominator="tokens", group=None
    )
    assert isinstance(filt, ZeroAdvantageFilter) and filt.rows_dropped == 3


class KeepEverything:
    """A user plugin overriding the default: keep all rows at weight 1, unless told to defer."""

    defer = False

    @grpo_patches.hookimpl
    def grpo_filter_zero_advantage(self, advantages, mask, denominator, group):
        if self.defer:
            return None
        rows = advantages.shape[0]
        return ZeroAdvantageFilter(torch.arange(rows), torch.ones(rows), 0, 0, 0, 1.0)


@pytest.fixture
def keep_everything():
    plugin = KeepEverything()
    grpo_patches.plugin_manager().register(plugin)
    yield plugin
    grpo_patches.plugin_manager().unregister(plugin)


def test_a_plugin_overrides_the_default(keep_everything):
    batch = BATCHES["mixed"][0]
    call = dict(advantages=batch["advantages"], mask=batch["mask"], denominator="tokens", group=None)
    assert hook().grpo_filter_zero_advantage(**call).rows_kept == ROWS
    keep_everything.defer = True  # None defers to the built-in filter
    assert hook().grpo_filter_zero_advantage(**call).rows_kept == ROWS - 3
