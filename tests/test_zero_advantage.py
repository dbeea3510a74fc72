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
from grpo_patches.errors import IncompatibleOptionsError, OptionError, UnknownFrameworkError
from grpo_patches.plugins import hook
from grpo_patches.zero_advantage import (
    AGGREGATIONS,
    ZeroAdvantageFilter,
    aggregation_for,
    filter_zero_advantage,
    require_filter_compatible,
)

DTYPE = torch.float64
TOL = 1e-6  # max relative difference, fp64
HIDDEN, VOCAB, WIDTH, ROWS = 8, 11, 7, 6
GA, MAX_COMPLETION, NUM_ITEMS, GLOBAL_TOKENS, GLOBAL_ROWS = 3, 9, 57.0, 123.0, 16.0


def _row_mean(l, m, clamp=True):  # noqa: E741 - l is the per-token loss
    count = m.sum(-1).clamp(min=1.0) if clamp else m.sum(-1)
    return (l * m).sum(-1) / count


#: (framework, mode, version, the framework's aggregation of per-token loss l with mask m)
CASES = {
    "trl-grpo": ("trl", "grpo", None, lambda l, m: _row_mean(l, m).mean() / GA),
    "trl-sapo": ("trl", "sapo", None, lambda l, m: _row_mean(l, m).mean() / GA),
    "trl-bnpo": ("trl", "bnpo", None, lambda l, m: (l * m).sum() / m.sum().clamp(min=1.0) / GA),
    "trl-dr_grpo": ("trl", "dr_grpo", None, lambda l, m: (l * m).sum() / (l.size(0) * MAX_COMPLETION) / GA),
    "trl-luspo": ("trl", "luspo", None, lambda l, m: (l * m).sum(-1).mean() / GA),
    "trl-dapo": ("trl", "dapo", None, lambda l, m: (l * m).sum() / (NUM_ITEMS / 2 * GA / 2)),
    "trl-cispo": ("trl", "cispo", None, lambda l, m: (l * m).sum() / (NUM_ITEMS / 2 * GA / 2)),
    "trl-vespo": ("trl", "vespo", None, lambda l, m: (l * m).sum() / (NUM_ITEMS / 2 * GA / 2)),
    "verl07-token-mean": ("verl", "token-mean", "0.7.1", lambda l, m: (l * m).sum() / (m.sum() + 1e-8)),
    "verl07-seq-mean-token-sum": ("verl", "seq-mean-token-sum", "0.7.1", lambda l, m: (l * m).sum(-1).mean()),
    "verl07-seq-mean-token-mean": (
        "verl", "seq-mean-token-mean", "0.7.1", lambda l, m: _row_mean(l, m, clamp=False).mean()
    ),
    "verl07-seq-mean-token-sum-norm": (
        "verl", "seq-mean-token-sum-norm", "0.7.1", lambda l, m: (l * m).sum() / m.shape[-1]
    ),
    "verl09-token-mean": ("verl", "token-mean", "0.9.1", lambda l, m: (l * m).sum() / GLOBAL_TOKENS),
    "verl09-seq-mean-token-mean": (
        "verl", "seq-mean-token-mean", "0.9.1", lambda l, m: _row_mean(l, m).sum() / GLOBAL_ROWS
    ),
    "nemo_rl-token": ("nemo_rl", "token", None, lambda l, m: (l * m).sum() / GLOBAL_TOKENS),
    "nemo_rl-sequence": ("nemo_rl", "sequence", None, lambda l, m: _row_mean(l, m).sum() / GLOBAL_ROWS),
}


def make_model(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(HIDDEN, VOCAB).to(DTYPE)


def token_logps(model: torch.nn.Linear, batch: dict) -> torch.Tensor:
    logits = model(batch["hidden"])
    return torch.log_softmax(logits, dim=-1).gather(-1, batch["tokens"].unsqueeze(-1)).squeeze(-1)


def make_batch(seed: int, zero_rows, rows: int = ROWS, per_token: bool = False) -> dict:
    """Ragged rows (1..WIDTH tokens), rows in ``zero_rows`` with advantage exactly 0."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, WIDTH + 1, (rows,), generator=g)
    batch = {
        "hidden": torch.randn(rows, WIDTH, HIDDEN, generator=g, dtype=DTYPE),
        "tokens": torch.randint(VOCAB, (rows, WIDTH), generator=g),
        "mask": (torch.arange(WIDTH) < lengths[:, None]).to(DTYPE),
    }
    advantages = torch.randn(rows, generator=g, dtype=DTYPE)
    if per_token:
        advantages = advantages[:, None] * torch.rand(rows, WIDTH, generator=g, dtype=DTYPE)
    advantages[list(zero_rows)] = 0.0
    batch["advantages"] = advantages
    with torch.no_grad():  # old log-probs off by up to ~0.5 so both clip branches are taken
        batch["old_logps"] = token_logps(make_model(), batch) + 0.5 * torch.randn(rows, WIDTH, generator=g, dtype=DTYPE)
    return batch


def grpo_token_loss(logps, old_logps, advantages, eps_low=0.2, eps_high=0.28):
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    ratio = torch.exp(logps - old_logps)
    return -torch.min(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)


def loss_and_grads(model, batch, aggregate, filt: ZeroAdvantageFilter | None = None, weights=None):
    rows = slice(None) if filt is None else filt.keep
    part = {k: v[rows] for k, v in batch.items()}
    per_token = grpo_token_loss(token_logps(model, part), part["old_logps"], part["advantages"])
    if filt is not None:
        per_token = per_token * (filt.weights if weights is None else weights)[:, None]
    loss = aggregate(per_token, part["mask"])
    return [loss.detach(), *torch.autograd.grad(loss, list(model.parameters()))]


def max_rel_diff(got: list, want: list) -> float:
    worst = 0.0
    for a, b in zip(got, want):
        scale = b.abs().max().item()
        diff = (a - b).abs().max().item()
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def tokens_of(batch, rows) -> int:
    return int(batch["mask"][list(rows)].sum().item())


BATCHES = {  # name -> (batch, zero rows, expected rows_dropped, expected padding rows)
    "mixed": (make_batch(1, [0, 2, 5]), [0, 2, 5], 3, 0),
    "all-zero": (make_batch(2, range(ROWS)), range(ROWS), ROWS - 1, 1),
    "none-zero": (make_batch(3, []), [], 0, 0),
    "per-token": (make_batch(4, [1, 3], per_token=True), [1, 3], 2, 0),
}


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("case", list(CASES))
def test_filter_reproduces_loss_and_gradient(model, case, batch_name):
    framework, mode, version, aggregate = CASES[case]
    batch, zero_rows, rows_dropped, padding = BATCHES[batch_name]
    filt = filter_zero_advantage(batch["advantages"], batch["mask"], aggregation_for(framework, mode, version=version))
    assert (filt.rows_dropped, filt.padding_rows) == (rows_dropped, padding)
    kept_zero = [int(i) for i in filt.keep if i in zero_rows]
    assert filt.tokens_dropped == tokens_of(batch, zero_rows) - tokens_of(batch, kept_zero)
    assert filt.keep.dtype == torch.long and filt.weights.dtype == DTYPE
    assert max_rel_diff(loss_and_grads(model, batch, aggregate, filt), loss_and_grads(model, batch, aggregate)) <= TOL


@pytest.mark.parametrize("case", ["trl-bnpo", "trl-grpo", "verl07-token-mean", "trl-dapo"])
def test_a_wrong_weight_is_detected(model, case):
    """The comparison is sharp: 1e-4 off in the weights, or naive dropping, fails it."""
    _, _, version, aggregate = CASES[case]
    framework, mode = CASES[case][:2]
    batch = BATCHES["mixed"][0]
    filt = filter_zero_advantage(batch["advantages"], batch["mask"], aggregation_for(framework, mode, version=version))
    want = loss_and_grads(model, batch, aggregate)
    assert max_rel_diff(loss_and_grads(model, batch, aggregate, filt, filt.weights * (1 + 1e-4)), want) > 10 * TOL
    if filt.scale != 1.0:  # local denominators: dropping rows without weights changes the result
        naive = torch.ones_like(filt.weights)
        assert max_rel_diff(loss_and_grads(model, batch, aggregate, filt, naive), want) > 1e-2


def test_weights_and_scale_values():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1]], dtype=DTYPE)
    adv = torch.tensor([0.0, 1.0, -0.0, -2.0], dtype=DTYPE)
    expect = {"token-mean": 4 / 9, "seq-mean-token-mean": 0.5, "seq-mean-token-sum": 0.5, "fixed-denominator": 1.0}
    for aggregation in AGGREGATIONS:
        filt = filter_zero_advantage(adv, mask, aggregation)
        assert filt.keep.tolist() == [1, 3] and filt.scale == pytest.approx(expect[aggregation], abs=0)
        assert filt.weights.tolist() == [expect[aggregation]] * 2
        assert (filt.rows_dropped, filt.tokens_dropped, filt.padding_rows, filt.rows_kept) == (2, 5, 0, 2)


def test_exact_zero_only_never_a_tolerance():
    """|A| = 2.4e-3 or 1e-300 from an 'identical rewards' group is kept; only 0.0 / -0.0 is dropped."""
    mask = torch.ones(4, 3)
    filt = filter_zero_advantage(torch.tensor([2.4e-3, 1e-300, 0.0, -0.0], dtype=DTYPE), mask, "token-mean")
    assert filt.keep.tolist() == [0, 1]
    nan = filter_zero_advantage(torch.tensor([float("nan"), 0.0]), torch.ones(2, 3), "token-mean")
    assert nan.keep.tolist() == [0]  # a NaN must still reach the loss
    assert nan.weights.dtype == torch.float32


def test_per_token_advantages_count_only_unmasked_tokens():
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([[0.0, 0.0, 5.0], [0.0, 0.3, 0.0], [0.0, 0.0, 0.0]])
    filt = filter_zero_advantage(adv, mask, "seq-mean-token-sum")
    assert filt.keep.tolist() == [1] and filt.weights.tolist() == [pytest.approx(1 / 3)]


def test_all_zero_keeps_the_shortest_row_at_weight_zero():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    filt = filter_zero_advantage(torch.zeros(3), mask, "token-mean")
    assert filt.keep.tolist() == [1] and filt.weights.tolist() == [0.0] and filt.scale == 0.0
    assert (filt.rows_dropped, filt.tokens_dropped, filt.padding_rows) == (2, 5, 1)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(OptionError, match="unknown aggregation 'mean'; valid ones are: token-mean"):
        filter_zero_advantage(torch.zeros(2), torch.ones(2, 3), "mean")
    with pytest.raises(ValueError, match="one advantage per row"):
        filter_zero_advantage(torch.zeros(3), torch.ones(2, 3), "token-mean")
    with pytest.raises(ValueError, match="mask's shape"):
        filter_zero_advantage(torch.zeros(2, 4), torch.ones(2, 3), "token-mean")
    with pytest.raises(ValueError, match="not initialised"):
        filter_zero_advantage(torch.zeros(2), torch.ones(2, 3), "token-mean", group=object())


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


def test_aggregation_for_covers_every_trl_loss_type():
    loss_types = _trl_loss_types_in_compute_loss()
    assert {"grpo", "bnpo", "dr_grpo"} <= loss_types  # in every supported TRL (0.20+); the scan works
    for loss_type in loss_types:
        assert aggregation_for("trl", loss_type) in AGGREGATIONS


def test_aggregation_for_verl_depends_on_version_and_nemo_is_global():
    assert aggregation_for("verl", "token-mean", version="0.7.1") == "token-mean"
    assert aggregation_for("verl", "seq-mean-token-sum-norm", version="0.7.1") == "fixed-denominator"
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert aggregation_for("verl", mode, version="0.8.0") == "fixed-denominator"
    assert aggregation_for("nemo-rl", "sequence") == aggregation_for("nemo_rl", "token") == "fixed-denominator"
    with pytest.raises(OptionError, match="needs version="):
        aggregation_for("verl", "token-mean")


def test_aggregation_for_unknown_mode_or_framework():
    with pytest.raises(OptionError, match=r"unknown trl loss mode 'gspo'; valid ones are: grpo, .*vespo"):
        aggregation_for("trl", "gspo")
    with pytest.raises(UnknownFrameworkError, match="valid names are: trl, verl, nemo_rl"):
        aggregation_for("openrlhf", "token-mean")


# --- settings that make the filter inexact -----------------------------------------------


def test_require_filter_compatible_message():
    with pytest.raises(IncompatibleOptionsError) as info:
        require_filter_compatible(beta=0.04, framework="trl")
    assert str(info.value) == (
        "the zero-advantage filter needs beta == 0 (got 0.04): a KL term gives zero-advantage rows a gradient. "
        "Set beta=0, or pass zero_advantage_filter=False (or 'auto') to grpo_patches.enable(...)"
    )


def test_require_filter_compatible_reports_every_offender():
    with pytest.raises(IncompatibleOptionsError) as info:
        require_filter_compatible(entropy_coeff=0.01, kl_loss_coef=0.0, router_aux_loss_coef=1e-3, my_coef=2.0)
    text = str(info.value)
    assert "entropy_coeff == 0 (got 0.01): an entropy bonus" in text
    assert "router_aux_loss_coef == 0 (got 0.001): a router aux loss" in text
    assert "my_coef == 0 (got 2.0): the term weighted by my_coef" in text and "kl_loss_coef" not in text
    with pytest.raises(IncompatibleOptionsError, match=r"top_entropy_quantile == 1 \(got 0.2\)"):
        require_filter_compatible(top_entropy_quantile=0.2)
    with pytest.raises(IncompatibleOptionsError, match=r"beta == 0 \(got nan\)"):
        require_filter_compatible(beta=float("nan"))
    with pytest.raises(OptionError, match="beta must be a number"):
        require_filter_compatible(beta="0")
    require_filter_compatible(beta=0.0, entropy_coef=-0.0, top_entropy_quantile=1.0, framework="trl")


# --- plugin manager ---------------------------------------------------------------------


def test_default_through_the_plugin_hook():
    batch = BATCHES["mixed"][0]
    filt = hook().grpo_filter_zero_advantage(
        advantages=batch["advantages"], mask=batch["mask"], aggregation="token-mean", group=None
    )
    assert isinstance(filt, ZeroAdvantageFilter) and filt.rows_dropped == 3


class KeepEverything:
    """A user plugin overriding the default: keep all rows at weight 1, unless told to defer."""

    defer = False

    @grpo_patches.hookimpl
    def grpo_filter_zero_advantage(self, advantages, mask, aggregation, group):
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
    call = dict(advantages=batch["advantages"], mask=batch["mask"], aggregation="token-mean", group=None)
    assert hook().grpo_filter_zero_advantage(**call).rows_kept == ROWS
    keep_everything.defer = True  # None defers to the built-in filter
    assert hook().grpo_filter_zero_advantage(**call).rows_kept == ROWS - 3
