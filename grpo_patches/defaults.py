"""Built-in hook implementations, registered ``trylast`` so user plugins win.

Each one only forwards to the framework-free implementation module; torch-using modules are
imported inside the hook so that importing grpo_patches stays cheap.
"""

from __future__ import annotations

from typing import Any, Mapping

from grpo_patches.hookspecs import hookimpl


@hookimpl(trylast=True)
def grpo_recompute_old_logps(framework, consumptions_left, window_steps_left, needed_elsewhere):
    from grpo_patches.recompute import needs_old_logps

    return needs_old_logps(consumptions_left, window_steps_left, needed_elsewhere)


@hookimpl(trylast=True)
def grpo_skip_reference_pass(framework, kl_coefficients, kl_metrics_requested):
    from grpo_patches.reference_pass import decide_reference_pass

    return decide_reference_pass(kl_coefficients=kl_coefficients, kl_metrics_requested=kl_metrics_requested)


@hookimpl(trylast=True)
def grpo_filter_zero_advantage(advantages, mask, denominator, group):
    from grpo_patches.zero_advantage import filter_zero_advantage

    return filter_zero_advantage(advantages, mask, denominator, group=group)


@hookimpl(trylast=True)
def grpo_lm_head_loss(hidden, weight, labels, advantages, mask, options: Mapping[str, Any]):
    from grpo_patches.tiled_loss import tiled_grpo_loss

    return tiled_grpo_loss(hidden, weight, labels, advantages, mask, **options)


@hookimpl(trylast=True)
def grpo_lm_head_token_stats(hidden, weight, labels, mask, options: Mapping[str, Any]):
    from grpo_patches.tiled_loss import tiled_token_stats

    return tiled_token_stats(hidden, weight, labels, mask, **options)


@hookimpl(trylast=True)
def grpo_report_savings(framework: str, savings: Mapping[str, float]) -> None:
    from grpo_patches.savings_totals import add_to_totals

    add_to_totals(framework, savings)
