"""Log-prob passes in TRL's ``GRPOTrainer``: the reference pass, confirmed and reported.

TRL itself never builds a reference model nor runs the reference pass when ``beta == 0``,
and logs no KL metric then. This observer asks the ``grpo_plan_logprob_passes`` hook for the
plan of each rollout, checks that TRL did what the plan says (a plan TRL cannot follow is
reported in status, never forced), counts the skipped reference passes and writes the
reasons into ``grpo_patches.status()["trl"]["notes"]``. The old-logprob pass is decided by
:mod:`grpo_patches.adapters.trl.recompute`; its plan reason is noted here too.
"""

from __future__ import annotations

from typing import Any

from grpo_patches import api
from grpo_patches.adapters.trl import metrics
from grpo_patches.adapters.trl.recompute import importance_sampling_on, last_decision, upstream_rule
from grpo_patches.plugins import hook
from grpo_patches.recompute import needs_old_logps


def observe_logprob_passes(instance: Any, output: dict) -> None:
    """After ``_generate_and_score_completions`` (training mode): plan, check, count, note."""
    sampling = importance_sampling_on(instance)
    decision = last_decision(instance)
    # stale-or-not as the recompute patch saw it; TRL's global rule when that patch is off
    stale = (
        needs_old_logps(decision.consumptions_left, decision.window_steps_left, importance_sampling=False)
        if decision
        else upstream_rule(instance)
    )
    plan = hook().grpo_plan_logprob_passes(
        framework="trl",
        kl_coefficients={"beta": float(instance.beta)},
        kl_metrics_requested=False,  # TRL logs "kl" only when beta != 0
        optimizer_step_before_consumption=bool(stale),
        importance_sampling=sampling,
    )
    if plan is None:
        return
    ran_reference = "ref_per_token_logps" in output
    if plan.skip_reference and not ran_reference:
        metrics.report(instance, reference_passes_skipped=1)
        api.note("trl", "reference_pass", f"skipped (TRL builds no reference model): {plan.reference_reason}")
    elif plan.skip_reference:
        api.note("trl", "reference_pass", f"runs: TRL needs it with beta={instance.beta!r} ({plan.reference_reason})")
    else:
        api.note("trl", "reference_pass", f"runs: {plan.reference_reason}")
    ran_old = "old_per_token_logps" in output
    api.note("trl", "old_logprob_plan", f"{'runs' if ran_old else 'skipped'}: {plan.old_reason}")
