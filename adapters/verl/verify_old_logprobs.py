"""What a verify step on verl's engine compares a skipped old-logprob pass with: the old
log-probs the patched loss really used (:mod:`.verify_engine` runs the pass and collects into
``UpdateCall.verify``; :mod:`.old_logprobs_engine`'s loss wrappers report here, the pass's values
of each micro-batch in ``MicroBatchCall.pass_old_log_probs``). Kept apart so that the dependency
goes one way: both import this module, it imports neither.
"""

from __future__ import annotations

from typing import Any

from grpo_patches import verify as core

from . import state

#: The field that carries the pass's old log-probs alongside the patched update's (never read by verl).
PASS_FIELD = "grpo_patches_verify_old_log_probs"


def expected(micro: Any) -> Any | None:
    """In the patched run's loss call (:mod:`.old_logprobs_engine`): the pass's old log-probs of this
    micro-batch (``None`` outside a verify step's patched run)."""
    if state.update().verify is None or PASS_FIELD not in micro.keys():
        return None
    return micro.select(PASS_FIELD).to_padded_tensor()[PASS_FIELD]


def used(old_log_prob: Any, response_mask: Any) -> None:
    """In the patched run's policy loss: the old log-probs it really used, against the pass."""
    capture, pass_values = state.update().verify, state.micro_batch().pass_old_log_probs
    if capture is None or pass_values is None:
        return
    capture.old_logprob_diffs.append(
        core.max_abs_diff(old_log_prob.detach(), pass_values.to(old_log_prob.device), response_mask))
