"""What a verify step on verl's engine compares a skipped old-logprob pass with: the old
log-probs the patched loss really used (:mod:`.verify_engine` runs the pass and collects;
:mod:`.old_logprobs_engine`'s loss wrappers report here). Kept apart so that the dependency
goes one way: both import this module, it imports neither.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

from grpo_patches import verify as core

#: The field that carries the pass's old log-probs alongside the patched update's (never read by verl).
PASS_FIELD = "grpo_patches_verify_old_log_probs"
_EXPECTED: contextvars.ContextVar = contextvars.ContextVar("grpo_patches_verl_verify_expected", default=None)
_DIFFS: contextvars.ContextVar = contextvars.ContextVar("grpo_patches_verl_verify_diffs", default=None)


def expect(micro: Any) -> contextvars.Token | None:
    """In the patched run's loss (:mod:`.old_logprobs_engine`): the pass's old log-probs of this micro-batch."""
    if _DIFFS.get() is None or PASS_FIELD not in micro.keys():
        return None
    return _EXPECTED.set(micro.select(PASS_FIELD).to_padded_tensor()[PASS_FIELD])


def forget(token: contextvars.Token | None) -> None:
    if token is not None:
        _EXPECTED.reset(token)


def used(old_log_prob: Any, response_mask: Any) -> None:
    """In the patched run's policy loss: the old log-probs it really used, against the pass."""
    diffs, expected = _DIFFS.get(), _EXPECTED.get()
    if diffs is None or expected is None:
        return
    diffs.append(core.max_abs_diff(old_log_prob.detach(), expected.to(old_log_prob.device), response_mask))


@contextlib.contextmanager
def collecting() -> Iterator[list]:
    diffs: list = []
    token = _DIFFS.set(diffs)
    try:
        yield diffs
    finally:
        _DIFFS.reset(token)
