"""The zero-advantage filter on DeepSpeed's engine: no backward for a dropped micro-batch.

open-instruct drives accumulation itself (``grpo_fast.py`` step): before each micro-batch's
``engine.backward(loss)`` it calls ``engine.set_gradient_accumulation_boundary(b)`` with ``b``
true on the group's last micro-batch, then ``engine.step()`` there. DeepSpeed reads the flag in
the backward: ZeRO-2/3 hand the group's accumulated gradient to the optimizer in the boundary
backward's epilogue (``stage_1_and_2.py``: ``averaged_gradients`` at ``is_gradient_accumulation_boundary``).

So for the micro-steps the filter drops (:mod:`.zero_advantage`; the same number on every rank in
each group, so that each backward's reduce pairs up): :func:`backward` does nothing (their loss is
exactly 0 and reaches no parameter: :mod:`.dropped_rows`), and :func:`set_gradient_accumulation_boundary`
sets the flag on the group's last backward that runs, which then closes the group as the boundary
backward would have; open-instruct's own ``engine.step()`` at the group's end is unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import bind
from grpo_patches.errors import PlaceholderError

from . import learners
from .state import Current, StepState


def _planned(engine: Any) -> tuple[StepState, Current] | None:
    found = learners.of_model(engine)
    if found is None or found[1] != "policy":
        return None
    step = found[0].state.step
    if step is None or step.plan is None or step.current is None:
        return None
    return step, step.current


def set_gradient_accumulation_boundary(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """The boundary on the last backward of the group that runs."""
    planned = _planned(instance)
    if planned is not None:
        step, current = planned
        if step.plan.last_backward[current.s]:
            return bind(wrapped, args, kwargs).call(wrapped, is_boundary=True)
    return wrapped(*args, **kwargs)


def backward(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """No backward for a dropped micro-step (its loss must be exactly 0)."""
    planned = _planned(instance)
    if planned is None or not planned[0].plan.dropped(planned[1].s):
        return wrapped(*args, **kwargs)
    loss = bind(wrapped, args, kwargs)["loss"]
    if float(loss.detach()) != 0.0:
        raise PlaceholderError(
            f"grpo_patches: micro-step {planned[1].s} was dropped by the zero-advantage filter (every response token "
            f"has advantage exactly 0) but open-instruct's loss on it is {float(loss.detach())!r}, not 0: a loss term "
            "the filter does not know gives it a gradient. Pass zero_advantage_filter=False to grpo_patches.enable(...)")
    return loss
