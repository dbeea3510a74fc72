"""A learner's step, followed through the calls it makes (``state.py`` says in which order).

``CollatedBatchData.to`` is the first thing ``PolicyTrainerRayProcess.step()`` and
``GRPOTrainModule.train_batch`` do with their batch; :func:`to` keeps the moved batch as this
thread's pending one, and :func:`step_of` (called by every wrapper that meets a learner's model)
turns it into the learner's :class:`~.state.StepState` the first time: the micro-batches the step
trains on, its accumulation groups and, when the filter is on, its zero-advantage plan.
:func:`micro_step` matches a training forward to its micro-step.
"""

from __future__ import annotations

from typing import Any, Callable

from . import FRAMEWORK, learners, reference, verify, zero_advantage
from .state import PENDING, Current, ForwardCall, StepState


def to(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``CollatedBatchData.to``: the moved batch is the one the next step trains on."""
    moved = wrapped(*args, **kwargs)
    PENDING.batch = moved
    return moved


def step_of(model: Any) -> tuple[learners.Learner, StepState, str] | None:
    """``(learner, its step, "policy" | "reference")`` for a model of a learner, ``None`` for any
    other model. A batch moved since the learner's last step begins a new step."""
    found = learners.of_model(model)
    if found is None:
        return None
    learner, role = found
    own = learner.state
    batch, PENDING.batch = PENDING.batch, None
    if batch is not None:
        own.step = PENDING.step = _begin(learner, batch)
    if own.step is None:
        return None  # a forward outside any step (e.g. open-instruct's weight-sync warm-up)
    return learner, own.step, role


def _begin(learner: learners.Learner, batch: Any) -> StepState:
    own = learner.state
    accumulation, kept = learner.accumulation(len(batch.query_responses))
    data = batch if kept == len(batch.query_responses) else batch[:kept]  # open-instruct's leftover drop
    epochs = int(learner.args.num_epochs)
    step = StepState(learner=learner, data=data, accumulation_steps=accumulation, epochs=epochs,
                     index={id(t): i for i, t in enumerate(data.query_responses)},
                     verify_first=own.optimizer_steps)
    groups = learner.optimizer_steps(kept, accumulation, epochs)
    own.optimizer_steps += groups
    step.verify_groups = verify.due_groups(step, groups)
    if FRAMEWORK.on("logprob_skip"):
        reference.on_step(learner, step)
    if FRAMEWORK.on("zero_advantage_filter") and zero_advantage.decide(learner):
        step.plan = zero_advantage.plan(learner, step)
    return step


def active() -> StepState | None:
    """The step this thread is in (the one it adopted last)."""
    return PENDING.step


def forward_call(model: Any, query_responses: Any) -> ForwardCall:
    """The :class:`ForwardCall` of ``forward_for_logprobs(model, query_responses, ...)`` (made once per
    call, by its outermost wrapper: a training forward is counted once)."""
    import torch

    found = step_of(model)
    if found is None:
        return ForwardCall()
    learner, step, role = found
    training = role == "policy" and torch.is_grad_enabled()
    current = micro_step(step, query_responses) if training else None
    return ForwardCall(learner=learner, step=step, role=role, training=training, current=current)


def micro_step(step: StepState, query_responses: Any) -> Current | None:
    """The micro-step a training forward of ``query_responses`` is (``None``: not one of the step's
    micro-batches, e.g. a forward of some other code)."""
    i = step.index.get(id(query_responses))
    if i is None:
        return None
    s = step.forwards
    if s % step.n != i:
        raise RuntimeError(
            f"grpo_patches: open-instruct trained micro-batch {i} as micro-step {s} of a step of {step.n} "
            "micro-batches; the adapter expects them in order every epoch (open-instruct's step moved?). "
            "Pass zero_advantage_filter=False, recompute=False and tiled_loss=False to grpo_patches.enable(...)")
    step.forwards += 1
    step.current = Current(s=s, i=i, epoch=s // step.n)
    return step.current
