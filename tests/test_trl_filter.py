"""Zero-advantage filter in TRL's GRPOTrainer: same training, less work.

Every run trains the tiny model for 3 optimizer steps with a reward that gives identical
rewards to every completion of half the prompts (exactly zero advantages there), patches off
vs on (only the filter: recompute and logprob_skip off, so the comparison isolates it; TRL
then computes old log-probs for every rollout, GA=3 and steps_per_generation=2).

Tolerances: the kept rows go through the model as a smaller batch and the weight gradient
sums fewer rows, so float reductions run in another order: not bitwise. Losses, grad norms
and metrics agree to 1e-5 relative; weights after 3 SGD steps (lr 5e-2) to 1e-6 absolute
(measured ~4e-9). SGD, because Adam divides by the gradient's magnitude: on weights whose
gradient is ~0 it turns rounding noise into lr-sized steps (measured 2e-4 with AdamW).
A wrong denominator would move the weights by ~1e-2. bf16=False keeps the CPU run in fp32
(GRPOConfig turns bf16 autocast on by default).

The kept-rows metrics (``dropped_rows_metrics=False``) are checked against values computed
here from the unpatched run's own entropies / VESPO weights (:class:`KeptRowsSpy`), and the
work saved against rows counted beneath the patches (``count_forwards``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from grpo_patches.errors import IncompatibleOptionsError  # noqa: E402

from grpo_patches_testing.trl_train import require_loss_type, train  # noqa: E402
from tests.helpers.trl_runs import (  # noqa: E402
    EXACT_METRICS, FORWARD_METRICS, LOSS_TYPES, ONLY_FILTER, assert_close_or_none, assert_same_metrics, run,
)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_filter_drops_rows_and_their_forwards_and_keeps_training(loss_type):
    require_loss_type(loss_type)
    ref = run(False, loss_type=loss_type)
    got = run(True, loss_type=loss_type)
    saved = got.savings
    assert saved["rows_dropped"] > 0 and saved["tokens_dropped"] > 0
    assert ref.global_step == got.global_step == 3
    assert ref.max_weight_diff(got) < 1e-6
    assert_same_metrics(ref, got, names=EXACT_METRICS)
    # the metrics that need the dropped rows' forward: over the kept rows, under another name
    for name in FORWARD_METRICS:
        assert not got.metrics(name)
        if ref.metrics(name):
            assert_close_or_none(ref.extra["spy"].kept_rows(name), got.metrics(name + "/kept_rows"))
    # work saved, counted beneath the patches: no forward at all for a dropped row
    assert saved["forward_rows_skipped"] == saved["rows_dropped"]
    assert got.forwards.with_grad == ref.forwards.with_grad - saved["rows_dropped"]
    assert saved["old_logprob_rows_skipped"] > 0
    assert got.forwards.no_grad == ref.forwards.no_grad - saved["old_logprob_rows_skipped"]
    assert got.notes()["zero_advantage_filter"].startswith("on")


def test_counts_are_logged_per_logging_step():
    ref, got = run(False, loss_type="grpo"), run(True, loss_type="grpo")
    per_step = got.metrics("grpo_patches/rows_dropped")
    assert per_step == ref.extra["spy"].rows_dropped()
    assert sum(per_step) == got.savings["rows_dropped"] and len(set(per_step)) > 1


@pytest.mark.parametrize("loss_type", ["grpo", "vespo"])
def test_dropped_rows_metrics_true_logs_every_metric_exactly(loss_type):
    require_loss_type(loss_type)
    ref = run(False, loss_type=loss_type)
    got = run(True, dropped_rows_metrics=True, loss_type=loss_type)
    saved = got.savings
    assert ref.max_weight_diff(got) < 1e-6
    assert_same_metrics(ref, got)
    assert not any(name.endswith("/kept_rows") for row in got.log_history for name in row)
    assert "forward_rows_skipped" not in saved and "old_logprob_rows_skipped" not in saved
    assert got.forwards.with_grad == ref.forwards.with_grad - saved["rows_dropped"]
    assert got.forwards.no_grad == ref.forwards.no_grad + saved["rows_dropped"]  # their metrics forward


def test_filter_off_with_beta_under_auto_says_so_and_changes_nothing():
    ref = run(False, beta=0.04)
    got = run(True, "auto", beta=0.04)
    note = got.notes()["zero_advantage_filter"]
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
