"""Verify mode (``verify_every``) on verl's Megatron actors: not covered yet, so never a silent no-op.

Neither the Megatron engine (0.8+, ``MegatronEngine.forward_backward_batch``) nor the legacy
``MegatronPPOActor`` (0.6.1-0.7.x, ``update_policy``) gets a verify step (:mod:`.verify_engine` and
:mod:`.verify_legacy` cover the FSDP engine and the legacy ``DataParallelPPOActor``): their first
training update raises with ``verify_every`` set, and ``enable("all")`` notes why in ``status()``.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import bind

from . import FRAMEWORK
from .calls_engine import actor_config_of

#: Why verify mode stays off on verl's Megatron actors.
WHY = "verify mode does not cover verl's Megatron actors yet: no check would run on their updates"


def forward_backward_batch(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``MegatronEngine.forward_backward_batch(data, loss_function, forward_only)``: a
    training call is refused (``verify_every`` set) or noted (``enable("all")``)."""
    call = bind(wrapped, args, kwargs)
    if instance is not None and not call["forward_only"] and actor_config_of(call["loss_function"]) is not None:
        FRAMEWORK.refuse_or_note("verify_every", WHY, owner=instance)
    return wrapped(*args, **kwargs)


def update_policy(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the legacy ``MegatronPPOActor.update_policy(dataloader)``: as :func:`forward_backward_batch`."""
    if instance is not None:
        FRAMEWORK.refuse_or_note("verify_every", WHY, owner=instance)
    return wrapped(*args, **kwargs)
