"""Faulty hook plugins the verify tests plant: verify mode must catch each one."""

from __future__ import annotations

import torch

import grpo_patches
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
