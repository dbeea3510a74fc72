"""The open-instruct adapter on the real DeepSpeed learner: ``PolicyTrainerRayProcess.step()``, patched
against unpatched, on a tiny Qwen2 in fp32 with SGD (per-step updates comparable exactly).

One batch per step: 16 responses (4 prompts x 4; prompt groups 0 and 3 get one score: advantage
exactly 0), ``filter_zero_std_samples=False`` (so that zero-advantage rows reach the learner),
packed at 32 tokens into 6 micro-batches of one row, of which the 4th and the 6th have advantage 0
(the 6th closes the second accumulation group at two mini-batches, and the only one at one:
DeepSpeed's boundary moves); temperature 0.7 (v0.3.0's default). Runs are shared between the tests
(each costs tens of seconds here): see :data:`RUNS`; the two-rank runs are in
``test_adapter_deepspeed_ranks.py``.
"""

from __future__ import annotations

import pytest

from grpo_patches_testing import open_instruct_cpu as harness
from tests.helpers.open_instruct_compare import (ALL_ON, ALL_ON_TILED, cached_runs, cold_tiled, counts, distance,
                                                dropping_a_useful_micro_batch, planted_fault_gap, stale_old_logprobs)

harness.load()  # skips without open-instruct / deepspeed on the path

BASE = harness.Config(steps=1, prompts=4, samples_per_prompt=4, zero_std_groups=(0, 3), pack_length=32,
                      num_mini_batches=2, num_epochs=2, temperature=0.7, snapshots=True)
Z3 = harness.replace(BASE, deepspeed_stage=3, num_mini_batches=1, num_epochs=1)
KL = harness.replace(BASE, num_mini_batches=1, num_epochs=1, beta=0.05)
#: The loss settings the tiled lm-head must reproduce beyond BASE's (dapo, rho on, beta 0): CISPO, truncated-IS
#: (rho) off, and each KL estimator at beta 0.05 (four optimizer steps: the policy leaves the reference after
#: the first, so every estimator's value is non-zero). At BASE's learning rate (0.5) the KL runs blow up (kl2
#: 4.9e16 after the second step, NaN weights): these steps are ten times smaller (kl2: 0.18; grad norms
#: 14.7, 6.1, 4.4, 5.4; fp32 rounding alone moves them by 9e-7: the lm-head's matmul in float64).
SMALL_STEPS = harness.replace(BASE, learning_rate=0.05)
LOSSES = {
    "cispo": harness.replace(SMALL_STEPS, loss_fn="cispo", args=(("record_entropy", True),)),  # entropies logged
    "no_rho": harness.replace(SMALL_STEPS, args=(("use_rho_correction", False),)),
    **{f"kl{k}": harness.replace(SMALL_STEPS, beta=0.05, kl_estimator=k) for k in range(4)},
}
#: name -> config; every run once per module (:func:`run`)
RUNS = {
    "zero2": BASE,
    "zero2_exact": harness.replace(BASE, enable=ALL_ON),
    "zero2_tiled": harness.replace(BASE, enable=dict(ALL_ON_TILED, verify_every=1)),
    "zero3": Z3,
    "zero3_tiled": harness.replace(Z3, enable=ALL_ON_TILED),
    "kl": KL,
    "kl_patched": harness.replace(KL, enable={}),  # every default option (filter "auto", logprob_skip)
    **LOSSES,
    # the tiled lm-head without the filter (which would log the entropies of the kept micro-batches only);
    # at beta > 0 the reference stays: the tiled lm-head answers its pass too
    **{f"{name}_tiled": harness.replace(config, enable=dict(tiled_loss=True, zero_advantage_filter=False))
       for name, config in LOSSES.items()},
}


@pytest.fixture(scope="module")
def run():
    return cached_runs(harness.train, RUNS)


def test_every_optimization_changes_nothing_of_the_update(run, record_property):
    """ZeRO-2, two mini-batches, two epochs, beta 0: no reference model, the pre-pass only over the
    micro-batches consumed after the first optimizer step, the zero-advantage micro-batch out of the
    forward and backward; grad norms, per-step updates and final weights as unpatched (fp32, SGD)."""
    base, patched = run("zero2"), run("zero2_exact")
    gap = distance(patched, base)
    record_property("exact_zero2_all", gap)
    assert gap <= 1e-6
    before, after = counts(base), counts(patched)
    record_property("saved_zero2", f"{before} -> {after}")
    assert base.ref_model_built and not patched.ref_model_built
    assert after["ref_forwards"] == 0 and before["ref_forwards"] == 6
    # accumulation_steps 3: the first group (3) is consumed before any optimizer step, the zero ones never
    assert before["old_logprob_forwards"] == 6 and after["old_logprob_forwards"] == 1
    assert after["policy_forwards"] == before["policy_forwards"] - 4  # two zero micro-batches, two epochs
    assert after["optimizer_steps"] == before["optimizer_steps"] == 4


def test_the_metrics_say_what_was_computed(run):
    base, patched = run("zero2").metrics[0], run("zero2_exact").metrics[0]
    for name in ("loss/policy_avg", "loss/total_avg", "loss/kl_avg", "policy/clipfrac_avg", "_token_count"):
        assert patched[name] == pytest.approx(base[name], rel=1e-6, abs=1e-7), name
    assert not any(name.startswith("objective/kl") for name in patched)  # no reference model behind them
    assert "val/ratio" not in patched and "val/ratio/kept_rows" in patched
    assert "debug/vllm_vs_local_logprob_diff_mean/kept_rows" in patched
    assert patched["grpo_patches/micro_batches_dropped"] == 4.0
    assert patched["grpo_patches/old_logprob_micro_batches_skipped"] == 5.0
    assert patched["grpo_patches/reference_micro_batches_skipped"] == 6.0


def test_the_tiled_lm_head_changes_nothing_and_makes_no_logits(run, record_property):
    """All optimizations and the tiled lm-head, verify mode on every step (its checks pass and
    leave the update alone): no [B, T, vocab] logits anywhere."""
    base, patched = run("zero2"), run("zero2_tiled")
    gap = distance(patched, base)
    record_property("exact_zero2_tiled", gap)
    assert gap <= 1e-5
    assert base.full_logits == 24 and patched.full_logits == 0
    assert patched.largest_logits[-1] != base.largest_logits[-1]
    verified = {k: v for k, v in patched.metrics[0].items() if k.startswith("grpo_patches/verify/")}
    record_property("verify_zero2_tiled", str(verified))
    assert set(verified) >= {"grpo_patches/verify/tiled_logprob_rel_diff", "grpo_patches/verify/tiled_grad_rel_diff",
                             "grpo_patches/verify/old_logprob_max_abs_diff",
                             "grpo_patches/verify/dropped_grad_max_abs"}
    assert verified["grpo_patches/verify/dropped_grad_max_abs"] == 0.0


def test_zero3_partitioned_lm_head(run, record_property):
    """ZeRO-3 (the tied lm-head / embedding partitioned), one mini-batch, one epoch."""
    base, patched = run("zero3"), run("zero3_tiled")
    assert base.lm_head_elements[1] == base.lm_head_elements[0]  # one rank holds the whole (partitioned) weight
    gap = distance(patched, base)
    record_property("exact_zero3_tiled", gap)
    assert gap <= 1e-5
    assert patched.full_logits == 0 and patched.ref_forwards == 0
    assert patched.policy_forwards == base.policy_forwards - 2


def test_with_a_kl_term_nothing_changes(run):
    """beta 0.05: the reference model stays, the filter is off (the KL term gives zero-advantage rows a
    gradient) and says why, the update is bitwise open-instruct's."""
    base, patched = run("kl"), run("kl_patched")
    assert patched.ref_model_built and patched.ref_forwards == base.ref_forwards
    assert counts(patched) == counts(base)
    assert distance(patched, base) == 0.0
    assert patched.status["notes"]["reference_pass"].startswith("runs: beta=0.05 non-zero")
    (notes,) = patched.status["by_class"].values()
    assert notes["zero_advantage_filter"].startswith("off: the zero-advantage filter needs beta == 0 (got 0.05)")


@pytest.mark.parametrize("loss", list(LOSSES))
def test_the_tiled_lm_head_reproduces_each_loss_setting(run, loss, record_property):
    """CISPO, rho off, KL estimators 0-3 at beta 0.05 (the reference's pass tiled too): open-instruct's loss
    code reads the tiled log-probs as it reads its own, so every setting trains as unpatched, no logits made."""
    base, patched = run(loss), run(f"{loss}_tiled")
    gap = _loss_gap(patched, base, loss)
    record_property(f"exact_tiled_{loss}", gap)
    assert gap <= 1e-5
    assert base.full_logits > 0 and patched.full_logits == 0
    assert patched.ref_forwards == (base.ref_forwards if LOSSES[loss].beta else 0)
    assert all(abs(base.metrics[0][name]) > 1e-3 for name in _kl_metrics(loss))  # the KL term is live
    (notes,) = patched.status["by_class"].values()
    assert notes["tiled_loss"].startswith("on:")  # nothing in a loss setting needs a refusal: the loss is theirs
    if loss == "cispo":  # record_entropy: the tiled entropies, logged as open-instruct's
        entropy = "policy/entropy_avg"
        assert patched.metrics[0][entropy] == pytest.approx(base.metrics[0][entropy], rel=1e-5)


def _kl_metrics(loss: str) -> list[str]:
    config = LOSSES[loss]
    return [f"objective/kl{config.kl_estimator}_avg", "loss/kl_avg"] if config.beta else []


def _loss_gap(patched, base, loss: str) -> float:
    """:func:`distance`, and for a KL estimator its logged values too (a gradient need not read the reference:
    kl0's, ``new - ref``, is the policy's own)."""
    logged = [abs(patched.metrics[0][name] - base.metrics[0][name]) / abs(base.metrics[0][name])
              for name in _kl_metrics(loss)]
    return max([distance(patched, base), *logged])


def test_a_model_the_tiled_lm_head_cannot_reproduce_is_refused_or_noted(run, monkeypatch):
    """A model family the tiled forward does not know (qwen2 taken off its list, so that the real check finds
    it): ``"auto"`` leaves open-instruct's own forward on with the reason in ``status()`` and trains bitwise as
    without the option; ``True`` refuses before the first forward."""
    from grpo_patches.adapters.open_instruct import lm_heads
    from grpo_patches.errors import IncompatibleOptionsError

    monkeypatch.setattr(lm_heads, "HF_MODEL_TYPES", tuple(t for t in lm_heads.HF_MODEL_TYPES if t != "qwen2"))
    noted = harness.train(harness.replace(BASE, enable=dict(ALL_ON, tiled_loss="auto")))
    (notes,) = noted.status["by_class"].values()
    assert notes["tiled_loss"].startswith("off: ") and "model_type='qwen2'" in notes["tiled_loss"]
    assert counts(noted) == counts(run("zero2_exact")) and noted.full_logits > 0
    assert distance(noted, run("zero2_exact")) == 0.0
    with pytest.raises(IncompatibleOptionsError, match="model_type='qwen2'"):
        harness.train(harness.replace(BASE, enable=dict(ALL_ON, tiled_loss=True)))


# --- planted faults: each one fails the comparison (or the guard) that proves its optimization ---------

def test_a_filter_that_drops_a_useful_micro_batch_is_caught(monkeypatch):
    """The dropped micro-step's loss is not 0 (it has a gradient): the guard on DeepSpeed's backward refuses
    before its optimizer step (measured: loss -2.43 on micro-step 0)."""
    from grpo_patches.adapters.open_instruct import zero_advantage
    from grpo_patches.errors import PlaceholderError

    monkeypatch.setattr(zero_advantage, "plan", dropping_a_useful_micro_batch(zero_advantage.plan))
    with pytest.raises(PlaceholderError, match="dropped by the zero-advantage filter .* not 0"):
        harness.train(RUNS["zero2_exact"])


def test_a_skipped_pre_pass_is_never_read_after_an_optimizer_step(monkeypatch):
    """A recompute decision that skips the micro-batches consumed after the first optimizer step: their
    placeholders reach the guard, which refuses before anything is computed from them."""
    from grpo_patches.adapters.open_instruct import old_logprobs
    from grpo_patches.errors import PlaceholderError

    monkeypatch.setattr(old_logprobs, "needed", lambda step: [False] * step.n)
    with pytest.raises(PlaceholderError, match="after the step's first optimizer step"):
        harness.train(RUNS["zero2_exact"])


def test_old_logprobs_from_the_wrong_weights_are_caught(run, record_property):
    """The guard planted wrong: every placeholder becomes the current log-probs, also after an optimizer step."""
    gap = planted_fault_gap(stale_old_logprobs(), lambda: harness.train(RUNS["zero2_exact"]), run("zero2"),
                            record_property, "fault_recompute_stale_old_logprobs")
    assert gap > 1e-3


def test_a_tiled_lm_head_at_the_wrong_temperature_is_caught(run, record_property):
    tiled = harness.replace(RUNS["zero2_tiled"], enable=ALL_ON_TILED)
    gap = planted_fault_gap(cold_tiled(), lambda: harness.train(tiled), run("zero2"), record_property,
                            "fault_tiled_temperature")
    assert gap > 1e-3


def test_a_reference_skipped_with_a_kl_term_is_caught(run, monkeypatch, record_property):
    from grpo_patches.adapters.open_instruct import reference
    from grpo_patches.reference_pass import ReferencePassDecision

    class Skip:
        def grpo_skip_reference_pass(self, **_):
            return ReferencePassDecision(True, "planted: skipped whatever beta is")

    monkeypatch.setattr(reference, "hook", lambda: Skip())
    # four optimizer steps: in the first the policy is the reference (kl and its gradient exactly 0)
    result = harness.train(harness.replace(RUNS["kl2"], enable={}))
    assert not result.ref_model_built
    gap = distance(result, run("kl2"))
    record_property("fault_reference_skipped_at_beta_0.05", gap)
    assert gap > 1e-6


@pytest.mark.parametrize("loss", list(LOSSES))
def test_a_wrong_tiled_log_prob_fails_each_loss_setting(run, loss, record_property):
    """The planted fault: the tiled log-probs at temperature 1 in the forwards that feed the setting's own
    term (the reference's pass for a KL estimator, the training forwards otherwise): the comparison fails."""
    with cold_tiled("reference" if LOSSES[loss].beta else "policy"):
        gap = _loss_gap(harness.train(RUNS[f"{loss}_tiled"]), run(loss), loss)
    record_property(f"fault_tiled_{loss}", gap)
    assert gap > 1e-3


# --- verify mode ---------------------------------------------------------------------------------------

def test_verify_mode_stops_a_wrong_tiled_lm_head():
    from grpo_patches.errors import ExactnessError

    with cold_tiled(), pytest.raises(ExactnessError, match="tiled_loss"):
        harness.train(harness.replace(BASE, enable=dict(ALL_ON_TILED, verify_every=1)))


def test_verify_mode_disable_trains_on_unpatched(run, record_property):
    """``verify_action="disable"``: the failing check's step uses open-instruct's own log-probs, and the
    tiled lm-head is off from there: the update is open-instruct's."""
    with cold_tiled():
        result = harness.train(harness.replace(BASE, enable=dict(ALL_ON_TILED, verify_every=1,
                                                                verify_action="disable")))
    gap = distance(result, run("zero2"))
    record_property("exact_verify_disable", gap)
    assert gap <= 1e-5
    assert "tiled_loss" in result.status["switched_off"]


def test_verify_mode_stops_a_filter_that_drops_a_useful_micro_batch(monkeypatch):
    """A filter decision (``grpo_filter_zero_advantage``) that drops micro-batches with a gradient: on a
    verified step they run, and the gradient of open-instruct's loss on them is not 0."""
    import torch

    from grpo_patches.adapters.open_instruct import zero_advantage
    from grpo_patches.errors import ExactnessError

    class LastOnly:  # keeps each group's last micro-step only, whatever the advantages
        def grpo_filter_zero_advantage(self, advantages, **_):
            return type("Answer", (), {"keep": torch.tensor([advantages.shape[0] - 1])})()

    monkeypatch.setattr(zero_advantage, "hook", lambda: LastOnly())
    with pytest.raises(ExactnessError, match="dropped_grad_max_abs"):
        harness.train(harness.replace(BASE, enable=dict(ALL_ON, verify_every=1)))
