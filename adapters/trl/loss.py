"""``GRPOTrainer.__init__``: check a new trainer's config for the loss patches at once.

An incompatible setting (``zero_advantage_filter=True`` with ``beta != 0``, ``tiled_loss=True``
with a setting it cannot reproduce) is then an error when the trainer is built, before any
generation; with ``"auto"`` the filter's on/off note is in ``status()`` from the start.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches import api

from . import filter as zero_advantage_filter
from . import tiled


def check_on_init(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``GRPOTrainer.__init__``."""
    result = wrapped(*args, **kwargs)
    options = api.active_options("trl")
    if options is not None and options.zero_advantage_filter is not False:
        zero_advantage_filter.decide(instance)  # raises for True, notes "on"/"off: why" for "auto"
    if options is not None and options.tiled_loss:  # select() refused it outside the tiled record's range
        tiled.check_supported(instance)
    return result
