"""The old-logprob pass of TRL's ``GRPOTrainer`` (TRL 0.20 - 1.16): computed exactly for the
rollouts that need it.

The one record on ``_generate_and_score_completions`` (:func:`generation_wrapper`) runs, per
training rollout, the recompute decision below (option ``recompute``), the pass deferred to
the rows the zero-advantage filter keeps (:mod:`.deferred_pass`: its placeholder and the pass
on the kept rows) and the reference-pass observer (option ``logprob_skip``, :mod:`.reference`),
so that the observer checks the output of the decided call and the options in force at call
time are read once. Evaluation calls pass straight through: they never use old log-probs.

TRL decides once for the whole run: ``_generate_and_score_completions`` computes old
log-probs iff ``args.gradient_accumulation_steps % (steps_per_generation * num_iterations)
!= 0`` (or the vLLM importance-sampling correction is on). That wastes a forward pass per
rollout when the rollout is consumed inside one accumulation window anyway, and goes stale
when the HF Trainer shortens a window (epoch end) while GA is a multiple of the rollout size.

The patch decides per rollout with the ``grpo_recompute_old_logps`` hook, fed with:

- ``window_steps_left``: micro-steps left in the HF Trainer's *real* accumulation window
  (:mod:`.accumulation_window`).
- ``consumptions_left``: ``spg * num_iterations - _step % (spg * num_iterations)`` (TRL's
  ``_step`` at generation, the same in every supported version), capped at the micro-steps
  left in training.

It applies the answer without copying TRL's method: for the duration of the call
``self.args`` is a view whose ``gradient_accumulation_steps`` makes TRL's own modulo test
give the hook's answer (TRL reads that field nowhere else in the method or below it).
The result is checked (``old_per_token_logps`` present iff decided), so a moved condition is
an error, never a silent stale rollout.

In verify mode, a rollout whose pass the decision skipped and that a verify step consumes gets
the pass anyway, TRL's own call made to run and its values taken out of the rollout again
(:mod:`.verify_rollout`): each micro-step compares them with what the loss used.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable

import wrapt

from grpo_patches import api
from grpo_patches.errors import GrpoPatchesWarning, UnsupportedFrameworkError
from grpo_patches.plugins import hook
from grpo_patches.recompute import cap_consumptions, explain, window_steps_left

from . import deferred_pass, metrics, overrides, state, verify_rollout
from .accumulation_window import steps_in_epoch, window_index, window_length
from .loss_types import importance_sampling_on
from .reference import observe_reference_pass
from .schedule import hf_micro_steps_left


@dataclass(frozen=True)
class RecomputeDecision:
    """One rollout's decision, kept on the trainer for the log-prob observer and tests."""

    compute: bool  # old log-probs are computed for this rollout (the hook's answer)
    upstream: bool  # what TRL's own modulo rule would have done
    consumptions_left: int
    window_steps_left: int
    importance_sampling: bool  # TRL's vLLM correction: the hook's ``needed_elsewhere``


def generate_every(trainer: Any) -> int:
    """Micro-steps that consume one rollout: ``steps_per_generation * num_iterations``."""
    return int(trainer.args.steps_per_generation) * int(trainer.num_iterations)


def upstream_rule(trainer: Any) -> bool:
    """TRL's own decision (0.20 - 1.16), the same for every rollout."""
    return trainer.args.gradient_accumulation_steps % generate_every(trainer) != 0 or importance_sampling_on(trainer)


def decide(trainer: Any) -> RecomputeDecision:
    """Ask the ``grpo_recompute_old_logps`` hook about the rollout generated now."""
    ga = int(trainer.args.gradient_accumulation_steps)
    window_len = window_length(trainer, ga)
    index = window_index(trainer)
    sampling = importance_sampling_on(trainer)
    upstream = upstream_rule(trainer)
    # more micro-steps than the window's length: a window that did not end where told (e.g.
    # transformers < 4.57 after a mid-epoch resume) or a changed loop; stay safe, recompute
    if index >= window_len:
        return RecomputeDecision(True, upstream, generate_every(trainer), 1, sampling)
    left_in_window = window_steps_left(index, window_len)
    every = generate_every(trainer)
    per_rollout = every - trainer._step % every
    state = trainer.state
    left_in_training = hf_micro_steps_left(state.global_step, state.max_steps, left_in_window, ga, steps_in_epoch(trainer))
    consumptions = cap_consumptions(per_rollout, max(left_in_training, 1))
    answer = hook().grpo_recompute_old_logps(
        framework="trl",
        consumptions_left=consumptions,
        window_steps_left=left_in_window,
        needed_elsewhere=sampling,
    )
    compute = upstream if answer is None else bool(answer) or sampling
    return RecomputeDecision(compute, upstream, consumptions, left_in_window, sampling)


class _ArgsView(wrapt.ObjectProxy):
    """``trainer.args`` with another ``gradient_accumulation_steps`` (everything else forwarded)."""

    def __init__(self, args: Any, gradient_accumulation_steps: int) -> None:
        super().__init__(args)
        self._self_gradient_accumulation_steps = gradient_accumulation_steps

    @property
    def gradient_accumulation_steps(self) -> int:
        return self._self_gradient_accumulation_steps


def decide_for_trainer(trainer: Any) -> bool:
    """Whether the exact recompute runs for ``trainer``: not when its class overrides the
    schedule it models (``training_step``, ``_prepare_inputs``) or the decided call; TRL's own
    rule then decides, which is what it does unpatched (noted per trainer class)."""
    own = state.of(trainer)
    if own.recompute_on is None:
        why = overrides.why_off(trainer, "recompute")
        own.recompute_on = why is None
        if why is not None:
            api.note("trl", "old_logprob_pass", f"TRL's own rule (recompute off for this class): {why}",
                     owner=trainer)
    return own.recompute_on


def exact_recompute(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``_generate_and_score_completions`` (training mode) computing old log-probs iff
    this rollout needs them. Called by :func:`generation_wrapper`."""
    decision = decide(instance)
    every = generate_every(instance)
    compute = decision.compute
    if compute and every == 1 and not decision.importance_sampling:
        # TRL's modulo test cannot be made true; a rollout consumed by one micro-step is on-policy
        warnings.warn(
            "grpo_patches: the grpo_recompute_old_logps hook asked for old log-probs with "
            "steps_per_generation * num_iterations == 1; TRL cannot compute them there and they "
            "are never needed (the rollout is consumed by the micro-step that generated it)",
            GrpoPatchesWarning,
            stacklevel=2,
        )
        compute = False
        decision = replace(decision, compute=False)
    force = verify_rollout.force_pass(instance, decision.upstream, compute)  # for verification only
    original_args = instance.__dict__["args"]
    instance.args = _ArgsView(original_args, every + 1 if compute or force else every)
    try:
        with verify_rollout.capturing(instance, force) as capture:
            output = wrapped(*args, **kwargs)
    finally:
        instance.args = original_args
    if force:
        if capture.output is None or "old_per_token_logps" not in output:
            raise UnsupportedFrameworkError(
                "grpo_patches verify: GRPOTrainer._generate_and_score_completions did not run its old-logprob "
                "pass when its modulo rule said so, so the skipped pass cannot be verified; pass verify_every=None"
            )
        output.pop("old_per_token_logps")  # compared with what the loss uses, never used
        verify_rollout.store(instance, output, capture.output[0], skipped=True, floor=capture.noise_floor)
    if ("old_per_token_logps" in output) != compute:
        raise UnsupportedFrameworkError(
            "grpo_patches: GRPOTrainer._generate_and_score_completions no longer follows the "
            f"gradient_accumulation_steps modulo rule (old log-probs {'missing' if compute else 'present'} "
            f"after deciding compute={compute}); disable this patch with grpo_patches.enable('trl', recompute=False)"
        )
    state.of(instance).last_decision = decision
    metrics.report(
        instance,
        old_logprob_passes_skipped=int(decision.upstream and not compute),
        old_logprob_passes_added=int(compute and not decision.upstream),
    )
    computed = metrics.add_count(instance, "old_logprob_passes", int(compute))
    rollouts = metrics.add_count(instance, "rollouts", 1)
    reason = explain(compute, decision.consumptions_left, decision.window_steps_left, decision.importance_sampling)
    api.note(
        "trl",
        "old_logprob_pass",
        f"computed for {int(computed)} of {int(rollouts)} rollouts "
        f"(TRL's modulo rule: {'every' if decision.upstream else 'none'}); last rollout: {reason}",
        owner=instance,
    )
    return output


def last_decision(trainer: Any) -> RecomputeDecision | None:
    """The decision taken for the trainer's latest rollout (``None`` before the first)."""
    return state.of(trainer).last_decision


def generation_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``_generate_and_score_completions``: the exact recompute and the
    deferred pass, then the reference-pass report, for each training rollout."""
    options = api.active_options("trl")
    if options is None or not instance.model.training:
        return wrapped(*args, **kwargs)
    state.of(instance).verify_rollout = None  # a new rollout: the last one's stored pass is spent
    with deferred_pass.deferring(instance) as deferred:
        if options.recompute and decide_for_trainer(instance):
            output = exact_recompute(wrapped, instance, args, kwargs)
        else:
            output = wrapped(*args, **kwargs)
        deferred_pass.complete(instance, deferred, output)
    if options.logprob_skip:
        observe_reference_pass(instance, output)
    return output
