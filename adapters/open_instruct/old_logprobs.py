"""The old-logprob pre-pass over the micro-batches a loss reads after an optimizer step (``recompute``).

With ``num_mini_batches > 1`` (and ``use_vllm_logprobs=False``) both learners run a no-grad
pre-pass, ``grpo_utils.compute_logprobs(model, data_BT, ...)``, over **every** micro-batch before
training, and read its result as the old log-probs (``resolve_old_logprob``). The micro-batches of
epoch 0's first accumulation group are consumed before the step's first optimizer step: their old
log-probs are the training forward's own (detached), exactly what open-instruct itself uses with
one mini-batch (its pre-pass and training forward agree bitwise, measured on ZeRO-2 and ZeRO-3).
Each later epoch reads the cache the first one filled.

So the pre-pass runs only over the micro-batches for which ``grpo_recompute_old_logps`` says yes,
asked per micro-batch ``i`` with ``consumptions_left = i + 1`` (the micro-steps from the step's
start to its first consumption, the one that fixes its old log-probs) and ``window_steps_left =
accumulation_steps`` (the micro-steps before the first optimizer step): the default computes them
iff ``i >= accumulation_steps``. The others get a NaN placeholder (:mod:`.placeholders`), which
``resolve_old_logprob`` replaces by the training forward's detached log-probs at epoch 0 before
any optimizer step, and otherwise refuses to hand to a loss.

Micro-batches the zero-advantage filter drops need no old log-probs at all (their loss is exactly 0
with any finite ones): they are left out of the pre-pass too, unless ``dropped_rows_metrics=True``.
The reference pass (``compute_logprobs(ref_policy, ...)``) is not changed here (:mod:`.reference`).
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches import verify as core_verify
from grpo_patches.call_args import bind
from grpo_patches.plugins import hook

from . import FRAMEWORK, placeholders, steps
from .state import LOGPROB_PASS, LogprobPass, StepState


def needed(step: StepState) -> list[bool]:
    """Per micro-batch: whether the pre-pass must compute its old log-probs.

    A micro-batch the filter runs in epoch 0 only to align the data-parallel ranks (advantage 0)
    needs none either, but gets them: every rank then runs the same number of pre-pass forwards
    (ZeRO-3 gathers the parameters in each), as the filter's plan makes every rank run the same
    number of micro-batches per group."""
    acc = step.accumulation_steps
    out = []
    for i in range(step.n):
        if step.plan is not None and not step.plan.runs[i] and not FRAMEWORK.setting("dropped_rows_metrics", False):
            out.append(False)
        elif FRAMEWORK.on("recompute"):
            answer = hook().grpo_recompute_old_logps(framework=FRAMEWORK.name, consumptions_left=i + 1,
                                                     window_steps_left=acc, needed_elsewhere=False)
            out.append(True if answer is None else bool(answer))
        else:
            out.append(True)
    return out


def compute_logprobs(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``grpo_utils.compute_logprobs``: the policy's no-grad pre-pass over the micro-batches that need it."""
    call_args = bind(wrapped, args, kwargs)
    data = call_args["data_BT"]
    found = steps.step_of(call_args["model"])
    pre_pass = found is not None and found[2] == "policy" and not call_args["use_grad"]
    if not pre_pass:
        with LOGPROB_PASS.entered(LogprobPass(data)):
            return wrapped(*args, **kwargs)
    learner, step, _role = found
    if len(data.query_responses) != step.n or any(a is not b for a, b in zip(data.query_responses,
                                                                              step.data.query_responses)):
        raise RuntimeError("grpo_patches: open-instruct's old-logprob pre-pass ran on other micro-batches than the "
                           "step trains (its step moved?); pass recompute=False and zero_advantage_filter=False")
    wanted = needed(step)
    if all(wanted):
        with LOGPROB_PASS.entered(LogprobPass(data)):
            return wrapped(*args, **kwargs)
    computed: dict[int, Any] = {}
    if any(wanted):
        subset = _subset(data, [i for i, w in enumerate(wanted) if w])
        with LOGPROB_PASS.entered(LogprobPass(subset)):
            values = call_args.call(wrapped, data_BT=subset)
        computed = dict(zip([i for i, w in enumerate(wanted) if w], values))
    skipped = [i for i, w in enumerate(wanted) if not w]
    window = [i for i in skipped if step.plan is None or step.plan.runs[i]]  # the rest: dropped micro-batches
    if window and 0 in step.verify_groups and FRAMEWORK.on("recompute"):  # verify mode: the pass really runs
        with core_verify.preserved_rng(), LOGPROB_PASS.entered(LogprobPass(_subset(data, window))) as running:
            step.verify_old = dict(zip(window, call_args.call(wrapped, data_BT=running.data)))
    dtype = next(iter(computed.values())).dtype if computed else learner.head_dtype(call_args["model"])
    for i in skipped:
        qr = data.query_responses[i]
        computed[i] = placeholders.new(step, i, (qr.shape[0], qr.shape[1] - 1), dtype, qr.device)
    saved = [i for i in skipped if i not in step.verify_old]  # what ran for verify mode is not a saving
    if saved:
        rows = sum(int(data.query_responses[i].shape[0]) for i in saved)
        step.add(old_logprob_micro_batches_skipped=len(saved), old_logprob_rows_skipped=rows)
        FRAMEWORK.report_savings(old_logprob_micro_batches_skipped=len(saved), old_logprob_rows_skipped=rows)
        _note(learner, step, saved)
    return [computed[i] for i in range(step.n)]


def _subset(data: Any, indices: list[int]) -> Any:
    """open-instruct's ``CollatedBatchData`` of some of ``data``'s micro-batches (the same tensors)."""
    import dataclasses

    return dataclasses.replace(data, **{f.name: [getattr(data, f.name)[i] for i in indices]
                                        for f in dataclasses.fields(data)})


def _note(learner: Any, step: StepState, skipped: list[int]) -> None:
    own = learner.state
    if "recompute" in own.notes_made:
        return
    own.notes_made.add("recompute")
    FRAMEWORK.note("old_logprob_pass", f"partial: the pre-pass skips the micro-batches consumed before the step's first "
                   f"optimizer step (their old log-probs are the training forward's own) and those the zero-advantage "
                   f"filter drops; first step: {len(skipped)} of {step.n} skipped", owner=learner.owner)
