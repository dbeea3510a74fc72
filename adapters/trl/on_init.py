"""``GRPOTrainer.__init__``: decide, once per new trainer, which optimizations run for it.

An incompatible setting or trainer class (``zero_advantage_filter=True`` with ``beta != 0``,
``tiled_loss=True`` with a loss it cannot reproduce, e.g. GMPOTrainer's) is then an error when
the trainer is built, before any generation; with ``"auto"`` the optimization is off for that
trainer and ``status()`` says why, per trainer class, from the start. A trainer built before
``grpo_patches.enable`` gets the same decisions at its first patched call.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from grpo_patches.errors import GrpoPatchesWarning

from . import FRAMEWORK, old_logprobs, overrides, packing, tiled, zero_advantage


def init(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``GRPOTrainer.__init__``."""
    result = wrapped(*args, **kwargs)
    if FRAMEWORK.on("recompute"):
        old_logprobs.decide_for_trainer(instance)
    if FRAMEWORK.on("zero_advantage_filter"):
        zero_advantage.decide(instance)  # raises for True, notes "off: why" for "auto"
    if FRAMEWORK.on("tiled_loss"):  # select() refused it outside the tiled record's range
        tiled.decide(instance)
    if FRAMEWORK.on("pack_kept_rows"):
        packing.decide(instance)
    if FRAMEWORK.on("verify_every"):
        why = overrides.why_off(instance, "verify_every")
        if why is not None:  # never say "verified" for a class whose loss bypasses the wrapper
            FRAMEWORK.note("verify", f"off for this class: {why}", owner=instance)
            warnings.warn(f"grpo_patches verify: {type(instance).__name__} is not verified: {why}",
                          GrpoPatchesWarning, stacklevel=2)
    return result
