"""The reference pass in TRL's ``GRPOTrainer``: TRL skips it itself at ``beta == 0``.

TRL itself never builds a reference model nor runs the reference pass when ``beta == 0``,
and logs no KL metric then. So nothing is patched for it: this observer (option
``logprob_skip``, called by :func:`.old_logprobs.generate_and_score_completions`) asks the
``grpo_skip_reference_pass`` hook about each rollout and checks that TRL did what it decided
(a decision TRL cannot follow is noted in status, never forced). A pass TRL skips on its own
is no saving of ours: it is noted per trainer class in ``status()``, never counted in the
savings. For the same reason verify mode has nothing to check here: with ``beta == 0`` the
unpatched TRL runs no reference pass either.
"""

from __future__ import annotations

from typing import Any

from grpo_patches.plugins import hook

from . import FRAMEWORK


def observe_reference_pass(instance: Any, output: dict) -> None:
    """After ``_generate_and_score_completions`` (training mode): decide, check, count, note."""
    decision = hook().grpo_skip_reference_pass(
        framework=FRAMEWORK.name,
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
    FRAMEWORK.note("reference_pass", text, owner=instance)
