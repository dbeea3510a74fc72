"""The zero-advantage filter for verl (option ``zero_advantage_filter``): whether it runs for
one actor, and in which mode (decided once, for every line).

``zero_advantage_filter=True`` with a setting that gives zero-advantage rows a gradient is
one clear error naming the setting and the fix; ``"auto"`` (or ``enable("all")``) switches
the filter off for that actor and says why in ``grpo_patches.status()`` (per actor class):
:func:`grpo_patches.refuse_or_note.refuse_or_note`.

Each line's filter: :mod:`.zero_advantage_legacy` (``DataParallelPPOActor``, 0.6.1-0.7.1;
:mod:`.dropped_rows_legacy` for ``dropped_rows_metrics=True``), :mod:`.zero_advantage_engine` (the
FSDP engine, 0.8+; :mod:`.dropped_rows_engine`), :mod:`.zero_advantage_megatron` (the Megatron
engine, 0.8+), :mod:`.zero_advantage_megatron_legacy` (``MegatronPPOActor``, 0.6.1-0.7.x).
"""

from __future__ import annotations

from typing import Any

from grpo_patches.zero_advantage import filter_problems

from . import FRAMEWORK, state
from .loss_modes import gradient_terms, unsupported_settings


def filter_mode(owner: Any, config: Any, extra_problems: tuple[str, ...] = ()) -> str | None:
    """``None`` (off), ``"pack"`` or ``"nograd"`` for the actor ``owner`` with actor ``config``.

    :raises grpo_patches.errors.IncompatibleOptionsError: ``zero_advantage_filter=True`` with a
        config the filter cannot reproduce exactly.
    """
    own = state.of(owner)
    if own.decided:
        return own.filter_mode
    mode = None
    if FRAMEWORK.on("zero_advantage_filter"):
        problems = [*filter_problems(gradient_terms(config)), *unsupported_settings(config), *extra_problems]
        if problems:
            FRAMEWORK.refuse_or_note("zero_advantage_filter", problems, owner=owner)
        else:
            mode = "nograd" if FRAMEWORK.setting("dropped_rows_metrics") else "pack"
            how = ("dropped rows get a no-grad forward (dropped_rows_metrics=True)" if mode == "nograd"
                   else "kept rows packed into fewer micro-batches; dropped rows cost no forward")
            FRAMEWORK.note("zero_advantage_filter", f"on: {how}", owner=owner)
    own.filter_mode, own.decided = mode, True
    return mode
