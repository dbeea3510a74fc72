"""Zero-advantage filter in TRL's GRPOTrainer: same training, fewer backward rows.

Every run trains the tiny model for 3 optimizer steps with a reward that gives identical
rewards to every completion of half the prompts (exactly zero advantages there), patches off
vs on (only the filter: recompute and logprob_skip off, so the comparison isolates it).

Tolerances: the kept rows go through the model as a smaller batch and the weight gradient
sums fewer rows, so float reductions run in another order: not bitwise. Losses, grad norms
and metrics agree to 1e-5 relative; weights after 3 SGD steps (lr 5e-2) to 1e-6 absolute
(measured ~4e-9). SGD, because Adam divides by the gradient's magnitude: on weights whose
gradient is ~0 it turns rounding noise into lr-sized steps (measured 2e-4 with AdamW).
A wrong denominator would move the weights by ~1e-2 here. bf16=False keeps the CPU run in
fp32 (GRPOConfig turns bf16 autocast on by default).
"""

from __future__ import annotations

import functools
import math

import pytest

pytest.importorskip("trl")

from grpo_patches import tiny_model  # noqa: E402
from grpo_patches.errors import IncompatibleOptionsError  # noqa: E402

from tests.trl_harness import require_loss_type, train  # noqa: E402

ONLY_FILTER = dict(recompute=False, logprob_skip=False, tiled_loss=False)
COMMON = dict(steps=3, reward_funcs=tiny_model.reward_constant_per_prompt, bf16=False, optim="sgd")
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
METRICS = (
    "loss",
    "grad_norm",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
    "cispo_clip_ratio",
    "vespo/phi_seq_mean",
    "kl",
)


@functools.lru_cache(maxsize=None)
def run(patched: bool, filter_value: object = True, **config: object):
    options = dict(ONLY_FILTER, zero_advantage_filter=filter_value) if patched else None
    return train(patched, options, **COMMON, **config)


def assert_same_metrics(ref, got, rel: float = 1e-5) -> None:
    for name in METRICS:
        expected, actual = ref.metrics(name), got.metrics(name)
        assert len(expected) == len(actual), name
        for e, a in zip(expected, actual):
            assert math.isclose(e, a, rel_tol=rel, abs_tol=1e-7), (name, expected, actual)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_filter_drops_rows_and_keeps_training(loss_type):
    require_loss_type(loss_type)
    ref = run(False, loss_type=loss_type)
    got = run(True, loss_type=loss_type)
    assert got.savings["rows_dropped"] > 0 and got.savings["tokens_dropped"] > 0
    assert sum(got.metrics("grpo_patches/rows_dropped")) == got.savings["rows_dropped"]  # per logging step
    assert got.status["notes"]["zero_advantage_filter"].startswith("on")
    assert ref.global_step == got.global_step == 3
    assert ref.max_weight_diff(got) < 1e-6
    assert_same_metrics(ref, got)


def test_filter_off_with_beta_under_auto_says_so_and_changes_nothing():
    ref = run(False, beta=0.04)
    got = run(True, "auto", beta=0.04)
    note = got.status["notes"]["zero_advantage_filter"]
    assert note.startswith("off:") and "beta" in note
    assert "rows_dropped" not in got.savings
    assert ref.same_weights(got)  # the loss path is untouched: bitwise
    assert_same_metrics(ref, got, rel=0.0)


@pytest.mark.parametrize(
    ("setting", "name"), [({"beta": 0.04}, "beta"), ({"top_entropy_quantile": 0.5}, "top_entropy_quantile")]
)
def test_filter_true_refuses_inexact_settings(setting, name):
    built: list = []  # trainer_hook runs once the trainer exists: the error must come before
    with pytest.raises(IncompatibleOptionsError, match=f"zero_advantage_filter=True.*{name}"):
        train(True, dict(ONLY_FILTER, zero_advantage_filter=True), steps=1, trainer_hook=built.append, **setting)
    assert built == []


def test_filter_false_does_not_wrap_compute_loss():
    import grpo_patches
    from trl import GRPOTrainer

    original = GRPOTrainer.__dict__["_compute_loss"]
    grpo_patches.enable("trl", **dict(ONLY_FILTER, zero_advantage_filter=False))
    try:
        assert GRPOTrainer.__dict__["_compute_loss"] is original
    finally:
        grpo_patches.disable("trl")
    grpo_patches.enable("trl", **dict(ONLY_FILTER, zero_advantage_filter=True))
    try:
        assert GRPOTrainer.__dict__["_compute_loss"] is not original
    finally:
        grpo_patches.disable("trl")
    assert GRPOTrainer.__dict__["_compute_loss"] is original
