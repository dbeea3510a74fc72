"""Log-prob passes in TRL's ``GRPOTrainer``: the reference pass, confirmed and reported.

TRL itself never builds a reference model nor runs the reference pass when ``beta == 0``,
and logs no KL metric then. This observer asks the ``grpo_skip_reference_pass`` hook about
each rollout and checks that TRL did what it decided (a decision TRL cannot follow is noted
in status, never forced). A pass TRL skips on its own is no saving of ours: it is noted per
trainer class in ``status()``, never counted in the savings. The old-logprob pass is decided by :mod:`.old_logprobs` (the ``grpo_recompute_old_logps``
hook); this observer only notes what ran.
"""

from __future__ import annotations

from typing import Any

from grpo_patches import api
from grpo_patches.plugins import hook



def observe_logprob_passes(instance: Any, output: dict) -> None:
    """After ``_generate_and_score_completions`` (training mode): decide, check, count, note."""
    decision = hook().grpo_skip_reference_pass(
        framework="trl",
        kl_coefficients={"beta": float(instance.beta)},
        kl_metrics_requested=False,  # TRL logs "kl" only when beta != 0
    )
    if decision is None:
        return
    ran_reference = "ref_per_token_logps" in output
    if decision.skip and not ran_reference:
        text = f"not run, by TRL itself (no reference model; not counted as a saving): {decision.reason}"
    elif decision.skip:
        text = f"runs: TRL needs it with beta={instance.beta!r} ({decision.reason})"
    else:
        text = f"runs: {decision.reason}"
    api.note("trl", "reference_pass", text, owner=instance)
