"""The zero-advantage filter with NeMo-RL's Megatron policy worker: not covered yet, never silently.

With ``policy.megatron_cfg.enabled`` NeMo-RL trains in ``MegatronPolicyWorker(Impl)``, on its own
micro-batches: no filter record of the DTensor worker reaches it. ``grpo.setup`` (driver, wrapped)
sees the config before any worker exists: ``"auto"`` says so in ``status()``, ``True`` raises one
clear error before training (compat/README.md, "NeMo-RL's Megatron worker", says what a filter
there needs). Nothing is imported from the Megatron worker (it needs Megatron-Bridge).
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches import api
from grpo_patches.refuse_or_note import refuse_or_note

from .calls import arguments
from .settings import setting
from .state import FRAMEWORK

WHY = ("NeMo-RL's Megatron policy worker (policy.megatron_cfg.enabled=true) is not covered by the zero-advantage "
       "filter yet; it trains on every row")


def setup_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``grpo.setup(master_config, ...)``: a note (``"auto"``) or an error (``True``) for a Megatron policy."""
    options = api.active_options(FRAMEWORK)
    config = arguments(wrapped, args, kwargs)["master_config"]
    if options is not None and options.zero_advantage_filter is not False \
            and setting(config, "policy.megatron_cfg.enabled", False):
        refuse_or_note(FRAMEWORK, "zero_advantage_filter", f"{WHY}; use the DTensor worker")
    return wrapped(*args, **kwargs)


def verify_setup_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``grpo.setup(master_config, ...)`` with ``verify_every``: verify mode does not cover the Megatron
    worker either, so a Megatron policy gets an error before training (a note under ``enable("all")``)."""
    config = arguments(wrapped, args, kwargs)["master_config"]
    if setting(config, "policy.megatron_cfg.enabled", False):
        refuse_or_note(FRAMEWORK, "verify_every", "verify mode does not cover NeMo-RL's Megatron policy worker yet: "
                       "no check would run on its updates; use the DTensor worker")
    return wrapped(*args, **kwargs)
