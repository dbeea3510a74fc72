"""What a ``GRPOTrainer`` subclass overrides that an optimization depends on.

A subclass that overrides a wrapped method bypasses the wrapper (unless it calls ``super()``),
and one that overrides a method an optimization's exactness rests on changes what it would
have to reproduce. Such an optimization is switched off for that trainer class (with a note
in ``status()``), or refused when it was asked for explicitly. The zero-advantage filter asks
:func:`.loss_modes.objective_of` instead: it also knows the losses of TRL's own subclasses.
"""

from __future__ import annotations

from typing import Any

from grpo_patches.patching import overriding_class

from . import GRPO_MODULE
from .loss_modes import class_name

#: option -> the GRPOTrainer methods it wraps or rests on.
DEPENDS_ON: dict[str, tuple[str, ...]] = {
    # the consumption schedule (which micro-step sees which rollout) and the decided call
    "recompute": ("training_step", "_prepare_inputs", "_generate_and_score_completions"),
    # the loss it reproduces and the policy forward it answers
    "tiled_loss": ("compute_loss", "_compute_loss", "_get_per_token_logps_and_entropies"),
    # verify mode's record: a micro-step's loss reaches it only through TRL's compute_loss
    "verify_every": ("compute_loss",),
    # the buffered generation batch it re-deals, the micro-step order it deals for, the loss it skips
    "pack_kept_rows": ("training_step", "_prepare_inputs", "_compute_loss"),
}


def overridden(trainer: Any, option: str) -> list[str]:
    """``"module.Class.method"`` for each method ``option`` depends on that ``trainer``'s class
    overrides (empty: the optimization sees TRL's own methods)."""
    import sys

    grpo = getattr(sys.modules.get(GRPO_MODULE), "GRPOTrainer", None)
    if grpo is None or not isinstance(trainer, grpo):
        return [f"{class_name(type(trainer))} (not a GRPOTrainer)"]
    found = []
    for method in DEPENDS_ON[option]:
        owner = overriding_class(type(trainer), grpo, method)
        if owner is not None:
            found.append(f"{class_name(owner)}.{method}")
    return found


def why_off(trainer: Any, option: str) -> str | None:
    """The reason ``option`` cannot run for ``trainer``'s class, or ``None``."""
    found = overridden(trainer, option)
    if not found:
        return None
    return f"{', '.join(found)} override{'s' if len(found) == 1 else ''} what {option} wraps or reproduces"
