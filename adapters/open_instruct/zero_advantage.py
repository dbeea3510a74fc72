"""The zero-advantage filter for open-instruct: whole micro-batches of exactly zero advantage skip
their forward and backward, the gradient unchanged.

open-instruct packs responses into rows (``rl_utils.pack_sequences``) and trains one micro-batch of
``per_device_train_batch_size`` rows per micro-step. A micro-batch whose response tokens all have
advantage exactly 0 adds exactly nothing to the gradient (:mod:`.loss_modes`: dapo and cispo are
products with the advantage, the rho weights multiply them, and the KL term is absent at beta 0),
so it only costs a forward and a backward. Its loss is still divided by the accumulation group's
token count, which open-instruct computes from the whole batch (``calculate_token_counts``,
all-reduced) before any micro-batch runs: the kept micro-batches' losses are unchanged.

Per accumulation group the filter asks ``grpo_filter_zero_advantage`` with one "row" per micro-step
(its advantage: whether any response token's advantage is non-zero; its mask: its response tokens,
so that the shortest zero micro-batches are the ones kept when one is needed) and the
``"fixed"`` denominator: every data-parallel rank then runs the same number of micro-batches in
each group (the maximum over the ranks, at least one: DeepSpeed's ZeRO-2/3 reduce in every
backward and its optimizer reads the group's gradients in the boundary backward; OLMo-core's
FSDP reduce-scatters in every backward). A zero micro-batch that runs does so unchanged: its
gradient is exactly 0.

open-instruct's own ``filter_zero_std_samples=True`` (its default) drops zero-std prompt groups
before packing and so renormalises the loss over fewer tokens (it changes the objective); then
hardly any micro-batch of zero advantage reaches the learner and ``"auto"`` leaves the filter off,
saying so. With ``filter_zero_std_samples=False`` the objective is open-instruct's full one and
the filter removes the cost of the zero-advantage rows exactly.
"""

from __future__ import annotations

from typing import Any

from grpo_patches.plugins import hook
from grpo_patches.zero_advantage import filter_problems

from . import FRAMEWORK
from .loss_modes import filter_terms, unsupported_loss
from .state import FilterPlan, StepState


def decide(learner: Any) -> bool:
    """Whether the filter runs for ``learner``, decided at its first step.

    :raises IncompatibleOptionsError: ``zero_advantage_filter=True`` with a setting it cannot reproduce.
    """
    own = learner.state
    if own.filter_on is not None:
        return own.filter_on
    args = learner.args
    problems = filter_problems(filter_terms(learner)) + unsupported_loss(args)
    if int(getattr(args, "sequence_parallel_size", 1) or 1) > 1:
        problems.append(f"sequence_parallel_size={args.sequence_parallel_size} splits each row over ranks that must "
                        "train the same micro-batches (use 1)")
    on = True
    if problems:
        on = FRAMEWORK.refuse_or_note("zero_advantage_filter", problems, owner=learner.owner)
    elif getattr(learner.owner.streaming_config, "filter_zero_std_samples", False) and not FRAMEWORK.strict(
            "zero_advantage_filter"):
        FRAMEWORK.note("zero_advantage_filter", "off: open-instruct's filter_zero_std_samples=True already drops "
                       "zero-std groups before packing (renormalising the loss over the remaining tokens); pass "
                       "filter_zero_std_samples=False to keep open-instruct's objective and let this filter drop "
                       "the zero-advantage micro-batches exactly", owner=learner.owner)
        on = False
    else:
        FRAMEWORK.note("zero_advantage_filter", "on: micro-batches whose response tokens all have advantage exactly 0 "
                       "skip their forward and backward (every data-parallel rank runs the same number per "
                       "accumulation group); metrics that need their forward say /kept_rows", owner=learner.owner)
    own.filter_on = on
    return on


def usefulness(step: StepState) -> tuple[list[bool], list[int]]:
    """Per micro-batch: whether a response token's advantage is not exactly 0 (NaN counts as not 0), and
    its response tokens (open-instruct's loss reads ``[:, 1:]`` of both)."""
    useful, tokens = [], []
    for advantages, mask in zip(step.data.advantages, step.data.response_masks):
        active = mask[:, 1:].bool()
        useful.append(bool(((advantages[:, 1:] != 0) & active).any()))
        tokens.append(int(active.sum()))
    return useful, tokens


def plan(learner: Any, step: StepState) -> FilterPlan:
    """Which micro-steps run, per accumulation group, the same count on every data-parallel rank."""
    import torch

    useful, tokens = usefulness(step)
    n, total = step.n, step.n * step.epochs
    runs = [True] * total
    last = [False] * total
    would_drop: set[int] = set()
    for start in range(0, total, step.accumulation_steps):
        group = range(start, min(start + step.accumulation_steps, total))
        advantages = torch.tensor([[1.0 if useful[s % n] else 0.0] for s in group])
        mask = torch.tensor([[float(tokens[s % n])] for s in group])
        answer = hook().grpo_filter_zero_advantage(advantages=advantages, mask=mask, denominator="fixed",
                                                   group=learner.dp_group)
        kept = {group[k] for k in answer.keep.tolist()} if answer is not None else set(group)
        if start // step.accumulation_steps in step.verify_groups:  # verify mode: the group runs as unpatched
            would_drop |= set(group) - kept
            kept = set(group)
        for s in group:
            runs[s] = s in kept
        last[max(kept)] = True
    dropped_tokens = sum(tokens[s % n] for s in range(total) if not runs[s])
    return FilterPlan(useful=useful, runs=runs, last_backward=last, tokens_dropped=dropped_tokens, would_drop=would_drop)
