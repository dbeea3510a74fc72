"""Verify mode, rollout side: TRL's old-logprob pass over every row of a rollout a verify step consumes.

Two optimizations change TRL's old-logprob pass (``_generate_and_score_completions``):

* the recompute decision (option ``recompute``, :mod:`.old_logprobs`) skips it for a rollout
  TRL's own rule would compute it for: the loss then uses the detached current log-probs;
* the deferred pass (:mod:`.old_logprob_rows`, part of ``zero_advantage_filter``) computes it
  only for the rows the filter keeps; the other rows hold a NaN placeholder.

This module's record on ``_generate_and_score_completions`` (option ``verify_every``, outermost:
:func:`generate_and_score_completions`) watches each rollout whose micro-steps fall on a
verify step (:func:`wanted`): it enters the rollout's :class:`~.state.RolloutCall` with an
:class:`Observer`, and the records inside do what they always do. The observer sees TRL's pass
over every row, with TRL's own method and arguments, no gradients and no trace on the random
state (:func:`full_pass`):

* a skipped pass: TRL runs its own call anyway where its rule says so
  (:attr:`~.state.RolloutCall.observed_pass`), answered by the observer; once the rollout is
  made, the values leave it again and are kept (:class:`~.state.StoredRollout`) for each
  micro-step to compare with the log-probs the loss used (:func:`.verify_rows.check_skipped`);
* a deferred pass: compared at once, kept rows against the full pass (:meth:`Observer.check_deferred`,
  ``grpo_patches/verify/old_logprob_max_abs_diff``), and kept too.

The unpatched computation of a verify micro-step reads the kept pass as TRL would
(:mod:`.verify_rows`). A pass TRL's rule does not run (an aligned schedule) is no saving of
ours, and a pass the decision adds (where TRL's rule goes stale) is what TRL should have run:
neither is verified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from grpo_patches import verify
from grpo_patches.errors import UnsupportedFrameworkError

from . import FRAMEWORK, logprob_pass, metrics, state
from .loss_modes import loss_mask
from .placeholders import KEY
from .row_subsets import is_multimodal
from .state import StoredRollout
from .verify_rows import ROW_KEYS, is_half, note_switched_off, tolerance


def wanted(trainer: Any) -> bool:
    """Whether a verify step consumes the rollout generated now: its ``steps_per_generation *
    num_iterations`` micro-steps span at most that many optimizer steps from this one."""
    step = int(trainer.state.global_step)
    span = int(trainer.args.steps_per_generation) * int(trainer.num_iterations)
    return any(FRAMEWORK.verify_due(s) for s in range(step, step + span))


def generate_and_score_completions(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``GRPOTrainer._generate_and_score_completions`` (option ``verify_every``)."""
    if not instance.model.training:
        return wrapped(*args, **kwargs)
    state.of(instance).verify_rollout = None  # a new rollout: the last one's kept pass is spent
    if not wanted(instance):
        return wrapped(*args, **kwargs)
    with state.ROLLOUT.entered(state.RolloutCall(observer=Observer())) as rollout:
        output = wrapped(*args, **kwargs)
    observer = rollout.observer
    if rollout.observed_pass:  # TRL's pass, run for verification only: out of the rollout, kept
        if observer.output is None or KEY not in output:
            raise UnsupportedFrameworkError(
                "grpo_patches verify: GRPOTrainer._generate_and_score_completions did not run its old-logprob "
                "pass when its modulo rule said so, so the skipped pass cannot be verified; pass verify_every=None"
            )
        output.pop(KEY)
        store(instance, output, observer.output[0], skipped=True, floor=observer.noise_floor)
    return output


def full_pass(trainer: Any, method: Callable[..., Any], arguments: Mapping[str, Any]) -> tuple[tuple, float | None]:
    """TRL's old-logprob pass over every row (``method``'s whole output) and, in half precision,
    its noise floor: the same pass with the rows in reverse order and half the chunk size, so
    that every row is computed in another batch (max abs diff over the completion tokens).
    The random state is left as it was (dropout draws)."""
    import torch

    with verify.preserved_rng():
        output = logprob_pass.run(trainer, method, arguments)
        floor = None
        if is_half(trainer) and not is_multimodal(arguments):
            values = output[0]
            rows = int(values.size(0))
            order = torch.arange(rows - 1, -1, -1, device=values.device)
            chunk = max(1, int(arguments.get("batch_size") or rows) // 2)
            again = logprob_pass.run(trainer, method, {**arguments, "batch_size": chunk}, order)[0].flip(0)
            floor = verify.max_abs_diff(again, values, arguments["attention_mask"][:, -values.size(1):])
    return output, floor


def store(trainer: Any, output: Mapping[str, Any], old: Any, skipped: bool, floor: float | None) -> StoredRollout:
    """Keep the full pass of the rollout ``output`` for the micro-steps that consume it."""
    stored = StoredRollout([output[key] for key in ROW_KEYS], old, skipped, floor)
    state.of(trainer).verify_rollout = stored
    return stored


@dataclass
class Observer:
    """Verify mode's look at one rollout's old-logprob pass (module docstring).

    :ivar output: TRL's pass over every row, where TRL ran it for verification only.
    :ivar noise_floor: its half-precision noise floor (:func:`full_pass`).
    """

    output: tuple | None = None
    noise_floor: float | None = None

    def answer(self, trainer: Any, method: Callable[..., Any], arguments: Mapping[str, Any], arity: int) -> tuple | None:
        """TRL's old-logprob call in a rollout whose pass the decision skipped (asked through
        :meth:`.state.RolloutCall.answer`): TRL's own pass over every row, with no trace on the
        random state (``None``: not that call)."""
        import torch

        if self.output is not None or torch.is_grad_enabled() or arguments.get("model") is not trainer.model:
            return None
        self.output, self.noise_floor = full_pass(trainer, method, arguments)
        return self.output

    def check_deferred(self, trainer: Any, method: Callable[..., Any], arguments: Mapping[str, Any],
                       output: Mapping[str, Any], old: Any, keep: Any) -> Any:
        """Compare the deferred pass's kept rows with TRL's pass over every row (TRL's log-prob
        ``method`` on TRL's ``arguments``); keep the latter.

        :returns: the old log-probs the rollout goes on with: ``old`` (the deferred pass, NaN
            placeholders in the other rows), or TRL's full pass when ``"disable"`` switched the
            filter off."""
        full_output, floor = full_pass(trainer, method, arguments)
        full = full_output[0].to(old.dtype)
        keep = keep.to(old.device)
        measured = verify.max_abs_diff(old[keep], full[keep], loss_mask(output)[keep])
        verdict = verify.check(FRAMEWORK.name, ["zero_advantage_filter"], int(trainer.state.global_step),
                               "old_logprob_max_abs_diff", measured, tolerance(trainer, floor),
                               detail="the old-logprob pass deferred to the kept rows against TRL's pass over every row")
        metrics.record_verify(trainer, verdict.metrics)
        store(trainer, output, full, skipped=False, floor=floor)
        if verdict.ok:
            return old
        note_switched_off(trainer, verdict, ["zero_advantage_filter"])
        return full
