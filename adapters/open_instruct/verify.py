"""Verify mode for open-instruct (``verify_every``): on chosen optimizer steps, each optimization against
the computation open-instruct would have made, on the same inputs and weights.

The unit is the optimizer step (open-instruct's accumulation group; 0-based over the run, counted
by :mod:`.steps`): the group of micro-steps ``s`` of a step is ``s // accumulation_steps``. On a
verified group:

* ``tiled_loss`` (:mod:`.verify_tiled`): every tiled forward of the group (and, on the step's
  first group, of its no-grad passes) is compared with open-instruct's own
  ``log_softmax_and_gather`` / ``entropy_from_logits`` on the full logits of the same hidden states,
  and its backward with the dense backward given the same incoming gradient (both :func:`grpo_patches.verify.rel_l2`: ``tiled_logprob_rel_diff``,
  ``tiled_grad_rel_diff``);
* ``recompute`` (:mod:`.old_logprobs`, :mod:`.placeholders`): on the step's first group the pre-pass
  the window skipped really runs (open-instruct's ``compute_logprobs``; the tiled lm-head, checked on
  its own, stays on) and each micro-batch's training forward is compared with it where the loss reads
  it (``old_logprob_max_abs_diff``: 0 expected);
* ``zero_advantage_filter`` (:mod:`.zero_advantage`, :mod:`.dropped_rows`): nothing of the group
  is dropped (it runs as unpatched open-instruct would), and the gradient of open-instruct's loss
  with respect to the log-probs of each micro-batch the filter would have dropped is taken from its
  real backward (a tensor hook): it must be exactly 0 (``dropped_grad_max_abs``), checked when the
  group's optimizer step comes (:func:`step` on DeepSpeed's engine, :func:`do_optim_step` on the
  OLMo-core train module). A gradient contribution ``J^T 0`` is exactly 0: the patched update equals
  the unpatched one.
* ``logprob_skip`` at beta 0: there is no reference model to compare with; the skipped term is
  ``0 * kl``, exact by construction (open-instruct's own ``load_ref_policy=False`` path).

Every check is one :func:`grpo_patches.verify.check` (one all-reduce over the data-parallel
group): the filter's plan makes every rank run the same micro-steps in a verified group, so each
rank makes the same checks in the same order. ``verify_action="disable"`` uses the unpatched value
for the failing check (the dense log-probs or gradient, the real pre-pass) and switches the
optimization off for the rest of the run (the filter from the next micro-step on).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from grpo_patches import verify

from . import FRAMEWORK, learners
from .state import StepState


def due_groups(step: StepState, groups: int) -> set[int]:
    """The step's accumulation groups verify mode checks."""
    if FRAMEWORK.setting("verify_every") is None:
        return set()
    return {g for g in range(groups) if FRAMEWORK.verify_due(step.verify_first + g)}


def judge(step: StepState, options: Sequence[str], group: int, quantity: str, measured: float, dtype: Any = None,
          limit: float | None = None) -> verify.Verdict:
    """One check of ``step``'s ``group``; the worst figure of the step goes into its metrics."""
    tolerance = verify.tolerance(FRAMEWORK.name, dtype) if limit is None else limit
    verdict = verify.check(FRAMEWORK.name, options, step.verify_first + group, quantity, measured, tolerance,
                           group=step.learner.dp_group)
    for name, value in verdict.metrics.items():
        step.verify_metrics[name] = max(step.verify_metrics.get(name, value), value)
    return verdict


def record_dropped_gradient(step: StepState, group: int, logps: Any) -> None:
    """Take ``|dLoss/dlogps|`` of a micro-batch the filter would have dropped from its real backward."""
    def seen(grad: Any) -> None:
        worst = float(grad.detach().abs().max()) if grad.numel() else 0.0
        step.verify_dropped[group] = max(step.verify_dropped.get(group, 0.0), worst)

    logps.register_hook(seen)


def _check_dropped(step: StepState | None) -> None:
    if step is None or step.plan is None or step.current is None:
        return
    group = step.group_of(step.current.s)
    if group not in step.verify_groups:
        return
    verdict = judge(step, ["zero_advantage_filter"], group, "dropped_grad_max_abs", step.verify_dropped.get(group, 0.0),
                    limit=0.0)
    if not verdict.ok:
        step.plan.run_all_from(step.current.s + 1, step.accumulation_steps)


def step(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``DeepSpeedEngine.step``: the filter's check of the group this optimizer step closes."""
    found = learners.of_model(instance)
    if found is not None and found[1] == "policy":
        _check_dropped(found[0].state.step)
    return wrapped(*args, **kwargs)


def do_optim_step(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``GRPOTrainModule._do_optim_step``: the same on the OLMo-core learner."""
    own = FRAMEWORK.peek(instance)
    _check_dropped(own.step if own is not None else None)
    return wrapped(*args, **kwargs)
