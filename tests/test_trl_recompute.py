"""TRL adapter, exact old-logprob recompute and log-prob passes: real GRPOTrainer runs on CPU.

Each test trains the tiny model with patches off and on and compares final weights and TRL's
logged metrics. Tolerance: bitwise. Where the patch skips a pass TRL would run, TRL uses
``per_token_logps.detach()`` instead of a separate no-grad forward of the same weights; on
CPU fp32 both give identical bits here (asserted), so any staleness or mis-scheduling shows
up as a weight difference (the "always stale" control below differs by > 1e-3).

The hook inputs the adapter computes are checked rollout by rollout against the schedule
simulator (:mod:`grpo_patches.adapters.trl.schedule`), which models TRL 1.16 / transformers 5.23.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("trl")

from grpo_patches.hookspecs import hookimpl  # noqa: E402
from grpo_patches.adapters.trl.schedule import simulate, trl_steps_per_epoch  # noqa: E402
from grpo_patches_testing.trl_train import train  # noqa: E402

pytestmark = pytest.mark.slow


def _hf_resumes_epoch_aligned() -> bool:
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version("4.57")


HF_RESUMES_EPOCH_ALIGNED = _hf_resumes_epoch_aligned()

#: TRL metrics that must be the same with the patch on (logged per optimizer step).
TRL_METRICS = ("loss", "grad_norm", "entropy", "reward", "reward_std", "clip_ratio/region_mean",
               "clip_ratio/low_mean", "clip_ratio/high_mean", "completions/mean_length")


class Recorder:
    """Records the recompute hook's inputs and defers (returns None) or forces an answer."""

    def __init__(self, answer=None, rule=None):
        self.calls: list[tuple[int, int, bool]] = []
        self.answer, self.rule, self.trainer = answer, rule, None

    @hookimpl(tryfirst=True)
    def grpo_recompute_old_logps(self, framework, consumptions_left, window_steps_left, needed_elsewhere):
        self.calls.append((consumptions_left, window_steps_left, needed_elsewhere))
        if self.rule is not None:
            return self.rule(self.trainer)
        return self.answer

    def attach(self, trainer):
        self.trainer = trainer


def issue_5770_rule(trainer) -> bool:
    """TRL issue #5770's proposal, ``_step // GA`` windows: ignores epoch ends (stale there)."""
    ga = trainer.args.gradient_accumulation_steps
    every = trainer.args.steps_per_generation * trainer.num_iterations
    a = trainer._step
    return a // ga != ((a // every + 1) * every - 1) // ga


def expected_inputs(ga, spg, iters, prompts, steps, resume=None, per_generation_prompts=2):
    spe = trl_steps_per_epoch(prompts // per_generation_prompts, spg, iters)
    sched = simulate(ga, spg, iters, spe, max_steps=steps, resume_at_optimizer_step=resume)
    return sched, [(r.consumptions_left, r.window_steps_left, False) for r in sched.rollouts]


def assert_same_metrics(a, b, names=TRL_METRICS, rel=0.0):
    """Same values; a run whose zero-advantage filter (on by default, dropping nothing with
    these rewards) logs ``<name>/kept_rows`` must log exactly TRL's value under it."""
    for name in names:
        va, vb = (r.metrics(name) or r.metrics(name + "/kept_rows") for r in (a, b))
        assert len(va) == len(vb), name
        for x, y in zip(va, vb):
            assert x == pytest.approx(y, rel=rel, abs=0.0 if rel == 0 else 1e-9), (name, va, vb)


def test_misaligned_across_an_epoch_end_is_exact_and_skips_passes():
    """GA=3, spg=2 (TRL recomputes every rollout), 8 prompts: 8 micro-steps per epoch, so the
    5 optimizer steps (windows 3, 3, 2 | 3, 3) cross an epoch end whose last window is 2 long
    and the next epoch's windows restart (micro-step 8 begins a window although 8 % 3 != 0)."""
    cfg = dict(gradient_accumulation_steps=3, steps_per_generation=2)
    upstream = train(False, steps=5, **cfg)
    rec = Recorder()
    patched = train(True, steps=5, plugins=[rec], **cfg)
    sched, inputs = expected_inputs(3, 2, 1, 8, 5)
    assert rec.calls == inputs
    needed = sum(r.recompute_needed for r in sched.rollouts)
    assert len(sched.rollouts) == 7 and needed == 2  # stale: the rollouts at micro-steps 2 and 10
    assert patched.savings == {"old_logprob_passes_skipped": 7 - needed}  # no reference pass: TRL skips it
    assert patched.same_weights(upstream)
    assert_same_metrics(patched, upstream)
    per_step = {name: patched.metrics(f"grpo_patches/{name}") for name in
                ("old_logprob_passes_skipped", "old_logprob_passes", "old_logprob_passes_added")}
    assert [sum(v) for v in per_step.values()] == [5, 2, 0]  # counts per logging step
    assert max(per_step["old_logprob_passes_skipped"]) < 5

    # Control: the comparison is sensitive to stale old log-probs. TRL issue #5770's
    # _step-based windows skip the rollout at micro-step 10 (wrong after the epoch end).
    rule = Recorder(rule=issue_5770_rule)
    stale = train(True, steps=5, plugins=[rule], trainer_hook=rule.attach, **cfg)
    assert stale.savings["old_logprob_passes_skipped"] == 5  # same count, one of them wrong
    assert stale.max_weight_diff(upstream) > 1e-4


def test_num_iterations_and_windows_longer_than_rollouts():
    """GA=5, spg=2, num_iterations=2 (4 consumptions per rollout): 2 of 4 rollouts skip."""
    cfg = dict(gradient_accumulation_steps=5, steps_per_generation=2, num_iterations=2)
    upstream = train(False, steps=3, **cfg)
    rec = Recorder()
    patched = train(True, steps=3, plugins=[rec], **cfg)
    sched, inputs = expected_inputs(5, 2, 2, 8, 3)
    assert rec.calls == inputs
    skipped = sum(not r.recompute_needed for r in sched.rollouts)
    assert skipped == 2 and patched.savings["old_logprob_passes_skipped"] == skipped
    assert patched.same_weights(upstream)
    assert_same_metrics(patched, upstream)


def test_aligned_config_matches_upstream_and_an_always_recompute_baseline():
    """GA=4, spg=2: TRL never recomputes and is right to; the patch agrees (nothing saved,
    nothing added) and both equal a baseline that always recomputes, at the detach tolerance."""
    cfg = dict(gradient_accumulation_steps=4, steps_per_generation=2)
    upstream = train(False, steps=2, **cfg)
    patched = train(True, steps=2, **cfg)
    always = train(True, steps=2, plugins=[Recorder(answer=True)], **cfg)
    assert patched.same_weights(upstream)
    assert patched.savings.get("old_logprob_passes_skipped", 0) == 0
    assert patched.savings.get("old_logprob_passes_added", 0) == 0
    assert always.savings["old_logprob_passes_added"] == 4
    assert always.max_weight_diff(upstream) <= 1e-6


class _DropLastMicroBatch:
    """Sampler view without the epoch's last micro-batch: epochs stop mid-rollout."""

    def __init__(self, base, indices_per_micro_step):
        self.base, self.drop = base, indices_per_micro_step

    def __iter__(self):
        return iter(list(self.base)[: -self.drop])

    def __len__(self):
        return len(self.base) - self.drop

    def set_epoch(self, epoch):
        getattr(self.base, "set_epoch", lambda e: None)(epoch)


def short_epoch_trainer():
    from trl import GRPOTrainer

    class ShortEpochTrainer(GRPOTrainer):
        """Epochs of 7 micro-steps with 2 consumptions per rollout (a custom sampler)."""

        def _get_train_sampler(self, dataset=None):
            base = super()._get_train_sampler(dataset)
            return _DropLastMicroBatch(base, self.args.per_device_train_batch_size * self.args.steps_per_generation)

    return ShortEpochTrainer


def test_shortened_window_where_trl_goes_stale_is_recomputed():
    """GA=2, spg=2 (aligned: TRL never recomputes) with 7-micro-step epochs: the epoch's last
    window is 1 long, so the rollout generated there is consumed after an optimizer step. TRL
    trains on stale ratio-1 old log-probs; the patch adds the pass and matches a baseline that
    always recomputes."""
    cfg = dict(gradient_accumulation_steps=2, steps_per_generation=2, trainer_class=short_epoch_trainer())
    upstream = train(False, steps=5, **cfg)
    rec = Recorder()
    patched = train(True, steps=5, plugins=[rec], **cfg)
    always = train(True, steps=5, plugins=[Recorder(answer=True)], **cfg)
    sched = simulate(2, 2, 1, 7, max_steps=5)
    assert rec.calls == [(r.consumptions_left, r.window_steps_left, False) for r in sched.rollouts]
    assert sum(r.recompute_needed for r in sched.rollouts) == 1
    assert patched.savings.get("old_logprob_passes_added") == 1
    assert "old_logprob_passes_skipped" not in patched.savings
    assert patched.max_weight_diff(always) <= 1e-6
    assert upstream.max_weight_diff(always) > 1e-4


def test_resume_from_checkpoint_restarts_the_counters(tmp_path):
    """A resume restarts TRL's _step and rebuilds the buffer mid-epoch; windows stay epoch
    aligned. The resumed patched run equals the resumed upstream run and the uninterrupted one."""
    cfg = dict(gradient_accumulation_steps=3, steps_per_generation=2)
    full = train(False, steps=4, output_dir=str(tmp_path), save_strategy="steps", save_steps=2, **cfg)
    checkpoint = str(tmp_path / "checkpoint-2")
    resumed_upstream = train(False, steps=4, output_dir=str(tmp_path), resume_from_checkpoint=checkpoint, **cfg)
    rec = Recorder()
    resumed = train(True, steps=4, output_dir=str(tmp_path), resume_from_checkpoint=checkpoint, plugins=[rec], **cfg)
    assert resumed.global_step == 4
    assert resumed.same_weights(resumed_upstream)
    if not HF_RESUMES_EPOCH_ALIGNED:
        # transformers < 4.57 restarts `step` after the skipped batches, so the resumed epoch's
        # last window never syncs and runs into the next epoch; the adapter then counts more
        # micro-steps than the window it was told and recomputes (the safe side), which the
        # simulator of transformers 5.x does not model.
        # (it also makes the resumed run differ from the uninterrupted one, patched or not)
        assert resumed.savings["old_logprob_passes_skipped"] > 0
        return
    assert resumed.max_weight_diff(full) <= 1e-5  # the HF resume restores RNG and data order
    sched, inputs = expected_inputs(3, 2, 1, 8, 4, resume=2)
    assert rec.calls == inputs
    assert resumed.savings["old_logprob_passes_skipped"] == sum(not r.recompute_needed for r in sched.rollouts) > 0


def test_beta_nonzero_keeps_the_reference_pass_and_kl_metric():
    cfg = dict(gradient_accumulation_steps=3, steps_per_generation=2, beta=0.1)
    upstream = train(False, steps=2, **cfg)
    patched = train(True, steps=2, **cfg)
    assert patched.same_weights(upstream)
    assert_same_metrics(patched, upstream, names=(*TRL_METRICS, "kl"))
    assert all(math.isfinite(v) for v in patched.metrics("kl"))
    assert "reference_passes_skipped" not in patched.savings
    assert patched.notes()["reference_pass"].startswith("runs: beta=0.1 non-zero")
    assert patched.savings["old_logprob_passes_skipped"] == 2


def test_beta_zero_reference_pass_is_noted_never_counted_as_a_saving():
    """TRL itself never runs the reference pass at beta=0: no saving of ours to report."""
    seen = {}

    def spy(trainer):
        seen["ref_model"] = trainer.ref_model

    patched = train(True, steps=1, trainer_hook=spy)
    assert seen["ref_model"] is None
    assert "kl" not in patched.log_history[0]
    assert not any("reference" in name for name in patched.savings)
    assert not any("reference" in name for row in patched.log_history for name in row)
    note = patched.notes()["reference_pass"]
    assert note.startswith("not run, by TRL itself (no reference model; not counted as a saving): beta=0.0")


def test_options_switch_parts_off():
    """recompute=False leaves TRL's decision (all rollouts recomputed with GA=3, spg=2)."""
    off = train(True, options={"recompute": False}, steps=1)
    assert "old_logprob_passes_skipped" not in off.savings
    # (training_step's record stays applied: it only counts the accumulation window, packing's input too)
    none = train(True, options={"recompute": False, "logprob_skip": False}, steps=1)
    assert none.savings == {} or set(none.savings) <= {"rows_dropped", "tokens_dropped"}
