"""Verify mode's pass-through: while a framework's unpatched computation runs, its records stand aside.

A verify step runs the framework's own computation a second time, as the unpatched framework
would (:mod:`grpo_patches.verify`). Every record of that framework must then call the original
(the filter, the skips, the tiled loss, the placeholder guards, also the wrappers that fire deep
inside the framework's call) — except verify mode's own records (option ``verify_every``), which
run and watch that computation. The patching layer applies this to every record
(:func:`grpo_patches.patching.apply_targets`): no adapter checks a flag for it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from grpo_patches.call_context import CallSlot

__all__ = ["active", "unpatched"]

#: Frameworks whose unpatched computation is running in this context.
_UNPATCHED: CallSlot[frozenset[str]] = CallSlot("unpatched")


def active(framework: str) -> bool:
    """Whether ``framework``'s unpatched computation is running (its records pass through)."""
    running = _UNPATCHED.current()
    return running is not None and framework in running


@contextlib.contextmanager
def unpatched(framework: str) -> Iterator[None]:
    """Run the block as ``framework`` without grpo_patches (verify mode's own records excepted)."""
    with _UNPATCHED.entered((_UNPATCHED.current() or frozenset()) | {framework}):
        yield
