"""Faulty hook plugins the verify tests plant: verify mode must catch each one.

Their answers break the hook's contract, which :mod:`grpo_patches.hook_contracts` refuses where an
adapter receives them; verify mode is the line behind it, for a fault no contract can see (a bug
inside a filter, an adapter applying a plan wrongly). The verify tests plant them
:func:`past_the_contract`, so that verify mode is the line under test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

import grpo_patches
from grpo_patches import hook_contracts
from grpo_patches.zero_advantage import ZeroAdvantageFilter, filter_zero_advantage


class DropsANonZeroRow:
    """A faulty ``grpo_filter_zero_advantage``: the default plan minus one row whose advantage is
    not zero (only for ``denominator`` in ``only``, when given; else the default answers)."""

    def __init__(self, only: tuple[str, ...] | None = None) -> None:
        self.only, self.calls = only, 0

    @grpo_patches.hookimpl
    def grpo_filter_zero_advantage(self, advantages, mask, denominator, group):
        if self.only is not None and denominator not in self.only:
            return None
        plan = filter_zero_advantage(advantages, mask, denominator, group=group)
        real = torch.nonzero(plan.weights != 0).flatten()
        if real.numel() < 2:
            return plan
        self.calls += 1
        kept = torch.ones(plan.keep.numel(), dtype=torch.bool)
        kept[real[0]] = False
        dropped = plan.keep[real[0]]
        return ZeroAdvantageFilter(plan.keep[kept], plan.weights[kept], plan.rows_dropped + 1,
                                   plan.tokens_dropped + int(mask[dropped].sum()), plan.padding_rows, plan.scale)


@contextlib.contextmanager
def past_the_contract(hook: str = "grpo_filter_zero_advantage") -> Iterator[None]:
    """``hook``'s answers reach the adapter unchecked for the duration (verify mode must catch them)."""
    check = hook_contracts.CONTRACTS.pop(hook)
    try:
        yield
    finally:
        hook_contracts.CONTRACTS[hook] = check


class WrongTiledHead:
    """A faulty ``grpo_lm_head_loss``: the tiled loss with its temperature or its head weight off by
    a small factor (a wrong transform, a stale or mis-gathered weight shard)."""

    def __init__(self, temperature: float = 1.0, weight: float = 1.0) -> None:
        self.temperature, self.weight = temperature, weight

    @grpo_patches.hookimpl
    def grpo_lm_head_loss(self, hidden, weight, labels, advantages, mask, options):
        from grpo_patches.tiled_loss import tiled_grpo_loss

        skewed = {**options, "temperature": options.get("temperature", 1.0) * self.temperature}
        return tiled_grpo_loss(hidden, weight * self.weight, labels, advantages, mask, **skewed)
