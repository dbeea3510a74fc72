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

import functools
import math

import pytest

pytest.importorskip("trl")

from grpo_patches.demo import tiny_model  # noqa: E402
from grpo_patches.errors import IncompatibleOptionsError  # noqa: E402

from tests.trl_harness import require_loss_type, train  # noqa: E402

ONLY_FILTER = dict(recompute=False, logprob_skip=False, tiled_loss=False)
COMMON = dict(steps=3, reward_funcs=tiny_model.reward_constant_per_prompt, bf16=False, optim="sgd",
              count_forwards=True)
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
#: Metrics the dropped rows cannot change: same name, same value with the default options.
EXACT_METRICS = (
    "loss",
    "grad_norm",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
    "cispo_clip_ratio",
)
#: Metrics computed from the dropped rows' forward: logged as <name>/kept_rows by default.
FORWARD_METRICS = ("entropy", "vespo/phi_seq_mean")
METRICS = (*EXACT_METRICS, *FORWARD_METRICS, "kl")


class KeptRowsSpy:
    """On an unpatched trainer, records every training loss call's advantages, mask, TRL's
    entropies and VESPO weights, to compute the kept-rows metrics independently."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def attach(self, trainer) -> None:
        import torch

        klass = type(trainer)

        def compute_loss(model, inputs):
            record = {"advantages": inputs["advantages"], "mask": inputs["completion_mask"],
                      "step": trainer.state.global_step}
            self.calls.append(record)

            def logps_and_entropies(*args, **kwargs):
                out = klass._get_per_token_logps_and_entropies(trainer, *args, **kwargs)
                if torch.is_grad_enabled():
                    record["entropy"] = out[1].detach()
                return out

            def gamma_weights(*args, **kwargs):
                record["phi"] = klass.get_gamma_weights(*args, **kwargs)
                return record["phi"]

            trainer._get_per_token_logps_and_entropies = logps_and_entropies
            trainer.get_gamma_weights = gamma_weights
            try:
                return klass._compute_loss(trainer, model, inputs)
            finally:
                del trainer._get_per_token_logps_and_entropies, trainer.get_gamma_weights

        trainer._compute_loss = compute_loss

    def _per_step(self, value, total: bool = False) -> list:
        """TRL's logging (logging_steps=1): per optimizer step, the mean of its micro-steps'
        values, NaN skipped (``total``: the sum, for counts)."""
        out = []
        for step in sorted({call["step"] for call in self.calls}):
            values = [value(call) for call in self.calls if call["step"] == step]
            values = [v for v in values if not math.isnan(v)]
            out.append((sum(values) if total else sum(values) / len(values)) if values else None)
        return out

    def kept_rows(self, name: str) -> list:
        def value(call):
            real = (call["advantages"] != 0).nonzero().flatten()
            if name == "entropy":
                mask = call["mask"][real].float()
                count = float(mask.sum())
                return float((call["entropy"][real] * mask).sum()) / count if count else math.nan
            return float(call["phi"][real].mean()) if real.numel() else math.nan

        return self._per_step(value)

    def rows_dropped(self) -> list:
        def value(call):
            rows, real = call["advantages"].numel(), int((call["advantages"] != 0).sum())
            return float(rows - max(real, 1))  # the filter keeps >= 1 row

        return self._per_step(value, total=True)


@functools.lru_cache(maxsize=None)
def run(patched: bool, filter_value: object = True, dropped_rows_metrics: bool = False, **config: object):
    if patched:
        options = dict(ONLY_FILTER, zero_advantage_filter=filter_value, dropped_rows_metrics=dropped_rows_metrics)
        return train(True, options, **COMMON, **config)
    spy = KeptRowsSpy()
    result = train(False, None, trainer_hook=spy.attach, **COMMON, **config)
    result.extra["spy"] = spy
    return result


def assert_same_metrics(ref, got, rel: float = 1e-5, names=METRICS) -> None:
    for name in names:
        expected, actual = ref.metrics(name), got.metrics(name)
        assert len(expected) == len(actual), name
        for e, a in zip(expected, actual):
            assert math.isclose(e, a, rel_tol=rel, abs_tol=1e-7), (name, expected, actual)


def assert_close_or_none(expected: list, actual: list) -> None:
    """``expected`` per step, None for a step without kept rows: that step logs no value."""
    present = [e for e in expected if e is not None]
    assert len(present) == len(actual) and all(not math.isnan(a) for a in actual)
    assert all(math.isclose(e, a, rel_tol=1e-5) for e, a in zip(present, actual))


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
