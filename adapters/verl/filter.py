"""Whether the zero-advantage filter runs for one verl actor, and in which mode (decided once).

``zero_advantage_filter=True`` with a setting that gives zero-advantage rows a gradient is
one clear error naming the setting and the fix; ``"auto"`` (or ``enable("all")``) switches
the filter off for that actor and says why in ``grpo_patches.status()`` (per actor class).
"""

from __future__ import annotations

from typing import Any

from grpo_patches import api
from grpo_patches.errors import IncompatibleOptionsError

from . import state
from .loss_modes import gradient_terms, unsupported_settings

FRAMEWORK = "verl"


def filter_mode(owner: Any, config: Any, extra_problems: tuple[str, ...] = ()) -> str | None:
    """``None`` (off), ``"pack"`` or ``"nograd"`` for the actor ``owner`` with actor ``config``.

    :raises IncompatibleOptionsError: ``zero_advantage_filter=True`` with a config the filter
        cannot reproduce exactly.
    """
    own = state.of(owner)
    if own.decided:
        return own.filter_mode
    options = api.active_options(FRAMEWORK)
    mode = None
    if options is not None and options.zero_advantage_filter is not False:
        from grpo_patches.zero_advantage import require_filter_compatible

        problems = [*unsupported_settings(config), *extra_problems]
        try:
            require_filter_compatible(gradient_terms(config))
        except IncompatibleOptionsError as exc:
            problems.insert(0, str(exc))
        if problems:
            text = "; ".join(problems)
            if "pass zero_advantage_filter=False" not in text:
                text += ". Change it, or pass zero_advantage_filter=False (or 'auto') to grpo_patches.enable(...)"
            if api.strict(FRAMEWORK, "zero_advantage_filter"):
                raise IncompatibleOptionsError(f"zero_advantage_filter=True: {text}") from None
            api.note(FRAMEWORK, "zero_advantage_filter", f"off: {text}", owner=owner)
        else:
            mode = "nograd" if options.dropped_rows_metrics else "pack"
            how = ("dropped rows get a no-grad forward (dropped_rows_metrics=True)" if mode == "nograd"
                   else "kept rows packed into fewer micro-batches; dropped rows cost no forward")
            api.note(FRAMEWORK, "zero_advantage_filter", f"on: {how}", owner=owner)
    own.filter_mode, own.decided = mode, True
    return mode
