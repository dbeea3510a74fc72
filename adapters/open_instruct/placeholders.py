"""The NaN placeholders of a skipped pre-pass, and the guard that keeps them out of every loss.

:mod:`.old_logprobs` hands open-instruct's step a NaN tensor for each micro-batch whose pre-pass it
skipped; the step stores it as that micro-batch's old log-probs and ``resolve_old_logprob`` hands
it to the loss. Wrapping ``resolve_old_logprob``, the guard replaces a placeholder (in open-instruct's
own cache, so that later epochs read the same) by the training forward's detached log-probs only
where that is exact:

* the micro-step comes before the step's first optimizer step (epoch 0's first accumulation
  group): the weights are still those the old log-probs are defined at;
* the micro-batch has advantage exactly 0 on every response token (the zero-advantage filter
  dropped it, or runs it only to align data-parallel ranks): its loss is 0 with any finite value.

Anywhere else a loss would read the placeholder: :class:`~grpo_patches.errors.PlaceholderError`,
before anything is computed.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import bind
from grpo_patches.errors import PlaceholderError

from . import FRAMEWORK
from .state import LEARNERS, StepState


def new(step: StepState, i: int, shape: tuple, dtype: Any, device: Any) -> Any:
    """Micro-batch ``i``'s placeholder: NaN until the guard fills in a value where one is exact."""
    import torch

    placeholder = torch.full(shape, float("nan"), dtype=dtype, device=device)
    step.placeholders[i] = placeholder
    return placeholder


def _holder(entry: Any, i: int) -> StepState | None:
    """The step whose placeholder ``entry`` is (``None``: a real value, or no pre-pass ran: one mini-batch)."""
    if entry is None:  # open-instruct's cache holds None where no pre-pass ran; never a placeholder
        return None
    for owner in list(LEARNERS):
        own = FRAMEWORK.peek(owner)
        step = own.step if own is not None else None
        if step is not None and step.placeholders.get(i) is entry:
            return step
    return None


def resolve_old_logprob(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``grpo_utils.resolve_old_logprob``: a placeholder becomes the detached current log-probs where exact."""
    call_args = bind(wrapped, args, kwargs)
    cache, i = call_args["old_logprobs_cache"], call_args["sample_idx"]
    step = _holder(cache[i], i) if 0 <= i < len(cache) else None
    if step is None:
        return wrapped(*args, **kwargs)
    current = step.current
    if current is None or current.i != i or current.epoch != call_args["epoch_idx"]:
        raise PlaceholderError(
            f"grpo_patches: open-instruct resolves the old log-probs of micro-batch {i} (epoch "
            f"{call_args['epoch_idx']}) outside the training forward the adapter saw ({current}); its skipped pre-pass "
            "left a placeholder there. Pass recompute=False to grpo_patches.enable(...)")
    before_first_step = current.s < step.accumulation_steps
    zero = step.plan is not None and not step.plan.useful[i]
    if not (before_first_step or zero):
        raise PlaceholderError(
            f"grpo_patches: the old log-probs of micro-batch {i} are a placeholder of the skipped pre-pass, but "
            f"open-instruct's loss reads them at micro-step {current.s}, after the step's first optimizer step "
            f"(accumulation_steps={step.accumulation_steps}): a grpo_recompute_old_logps plugin skipped a pass that "
            "was needed? Nothing was computed. Fix the plugin or pass recompute=False to grpo_patches.enable(...)")
    cache[i] = call_args["new_logprobs"].detach()
    if i in step.verify_old:  # verify mode: the pass the window skipped, run for the comparison
        from grpo_patches import verify as core_verify

        from .verify import judge

        real = step.verify_old.pop(i)
        verdict = judge(step, ["recompute"], 0, "old_logprob_max_abs_diff",
                        core_verify.max_abs_diff(cache[i].float(), real.float()), dtype=real.dtype)
        if not verdict.ok:
            cache[i] = real
    del step.placeholders[i]
    return wrapped(*args, **kwargs)
