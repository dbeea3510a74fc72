"""Savings: what each framework's patches avoided, reported through the hook, for status() and metrics."""

from __future__ import annotations

from grpo_patches.plugins import hook
from grpo_patches.savings_totals import reset, totals

__all__ = ["report", "reset", "totals"]


def report(framework: str, **savings: float) -> None:
    """Report work saved through the ``grpo_report_savings`` hook (all observers see it)."""
    hook().grpo_report_savings(framework=framework, savings=savings)
