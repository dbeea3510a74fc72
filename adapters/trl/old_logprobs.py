"""The old-logprob pass of TRL's ``GRPOTrainer`` (TRL 0.20 - 1.16): computed exactly for the
rollouts that need it.

The record on ``_generate_and_score_completions`` (:func:`generate_and_score_completions`)
runs, per training rollout, the recompute decision below (option ``recompute``), the pass
deferred to the rows the zero-advantage filter keeps (:mod:`.old_logprob_rows`: its placeholder
and the pass on the kept rows) and the reference-pass observer (option ``logprob_skip``,
:mod:`.reference`), so that the observer checks the output of the decided call. Evaluation
calls pass straight through: they never use old log-probs. What it hands the other records
of the rollout goes through the :class:`~.state.RolloutCall` (:mod:`.state`).

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
give the hook's answer (TRL reads that field nowhere else in the method or below it) — or run
TRL's pass where verify mode observes the rollout and TRL's own rule runs it
(:attr:`~.state.RolloutCall.observed_pass`: :mod:`.verify_rollout` takes the values out again).
The result is checked (``old_per_token_logps`` present iff TRL's pass was made to run), so a
moved condition is an error, never a silent stale rollout.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable

import wrapt

from grpo_patches.errors import GrpoPatchesWarning, UnsupportedFrameworkError
from grpo_patches.plugins import hook
from grpo_patches.recompute import cap_consumptions, explain, window_steps_left

from . import FRAMEWORK, metrics, old_logprob_rows, overrides, state
from .accumulation_window import steps_in_epoch, window_index, window_length
from .loss_modes import importance_sampling_on
from .placeholders import KEY
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
        framework=FRAMEWORK.name,
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
            FRAMEWORK.note("old_logprob_pass", f"TRL's own rule (recompute off for this class): {why}", owner=trainer)
    return own.recompute_on


def rollout_decision(trainer: Any) -> RecomputeDecision:
    """:func:`decide`, narrowed to what TRL can be made to do."""
    decision = decide(trainer)
    if decision.compute and generate_every(trainer) == 1 and not decision.importance_sampling:
        # TRL's modulo test cannot be made true; a rollout consumed by one micro-step is on-policy
        warnings.warn(
            "grpo_patches: the grpo_recompute_old_logps hook asked for old log-probs with "
            "steps_per_generation * num_iterations == 1; TRL cannot compute them there and they "
            "are never needed (the rollout is consumed by the micro-step that generated it)",
            GrpoPatchesWarning,
            stacklevel=2,
        )
        decision = replace(decision, compute=False)
    return decision


def exact_recompute(wrapped: Callable, instance: Any, args: tuple, kwargs: dict, rollout: state.RolloutCall) -> Any:
    """Run ``_generate_and_score_completions`` with TRL's modulo rule made to give the rollout's
    decision (or to run TRL's pass for verify mode's observer), check that it did, count it."""
    decision, every = rollout.decision, generate_every(instance)
    runs = decision.compute or rollout.observed_pass
    original_args = instance.__dict__["args"]
    instance.args = _ArgsView(original_args, every + 1 if runs else every)
    try:
        output = wrapped(*args, **kwargs)
    finally:
        instance.args = original_args
    if (KEY in output) != runs:
        raise UnsupportedFrameworkError(
            "grpo_patches: GRPOTrainer._generate_and_score_completions no longer follows the "
            f"gradient_accumulation_steps modulo rule (old log-probs {'missing' if runs else 'present'} where "
            f"the rule was made {'true' if runs else 'false'}); disable this patch with "
            "grpo_patches.enable('trl', recompute=False)"
        )
    state.of(instance).last_decision = decision
    compute = decision.compute
    metrics.report(
        instance,
        old_logprob_passes_skipped=int(decision.upstream and not compute),
        old_logprob_passes_added=int(compute and not decision.upstream),
    )
    computed = metrics.add_count(instance, "old_logprob_passes", int(compute))
    rollouts = metrics.add_count(instance, "rollouts", 1)
    reason = explain(compute, decision.consumptions_left, decision.window_steps_left, decision.importance_sampling)
    FRAMEWORK.note(
        "old_logprob_pass",
        f"computed for {int(computed)} of {int(rollouts)} rollouts "
        f"(TRL's modulo rule: {'every' if decision.upstream else 'none'}); last rollout: {reason}",
        owner=instance,
    )
    return output


def last_decision(trainer: Any) -> RecomputeDecision | None:
    """The decision taken for the trainer's latest rollout (``None`` before the first)."""
    return state.of(trainer).last_decision


def generate_and_score_completions(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``GRPOTrainer._generate_and_score_completions``, per training rollout: the
    recompute decision, the deferral of the pass it runs, TRL's method, the deferred pass on the
    kept rows, then the reference-pass report."""
    if not instance.model.training:
        return wrapped(*args, **kwargs)
    with state.ROLLOUT.joined(state.RolloutCall) as rollout:
        exact = FRAMEWORK.on("recompute") and decide_for_trainer(instance)
        if exact:
            rollout.decision = rollout_decision(instance)
        if not exact or rollout.decision.compute:  # a pass the rollout uses: deferred to the kept rows?
            rollout.deferred = old_logprob_rows.deferral(instance)
        output = exact_recompute(wrapped, instance, args, kwargs, rollout) if exact else wrapped(*args, **kwargs)
        old_logprob_rows.complete(instance, rollout, output)
    if FRAMEWORK.on("logprob_skip"):
        observe_reference_pass(instance, output)
    return output
