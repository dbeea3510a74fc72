"""What a wrapper of verl's engine (0.8+) reads from its calls beyond their arguments
(:func:`grpo_patches.call_args.bind`): a policy update's call, the actor config behind the loss
function, and a batch's advantages and response mask in the padded layout.

Shared by the filter, the reference and old-logprob skips, the tiled loss and verify mode, so
that each reads verl's calls the same way.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from grpo_patches.call_args import bind

#: The attribute a loss-function wrapper carries its actor config under (seen by :func:`actor_config_of`).
CONFIG_ATTRIBUTE = "grpo_patches_actor_config"


def policy_update_call(wrapped: Callable[..., Any], instance: Any, args: tuple,
                       kwargs: dict) -> tuple[Any, Callable, Any] | None:
    """``(data, loss_function, actor config)`` of a ``forward_backward_batch`` call that updates the policy on
    advantages (what the filter acts on); ``None`` for every other call (forward only, a loss
    that is not the actor's ``ppo_loss``, no advantages, an unbound call), which passes through."""
    call = bind(wrapped, args, kwargs)
    data, loss_function = call["data"], call["loss_function"]
    config = actor_config_of(loss_function)
    if instance is None or call["forward_only"] or config is None or "advantages" not in data.keys():
        return None
    return data, loss_function, config


def loss_call_data(args: tuple, kwargs: dict) -> Any:
    """The micro-batch a loss-function call gets (verl calls it ``loss_function(model_output, data, dp_group)``)."""
    return kwargs["data"] if "data" in kwargs else args[1]


def actor_config_of(loss_function: Any) -> Any | None:
    """The actor config of verl's ``partial(ppo_loss, config=...)`` (``None`` for other losses)."""
    wrapped_config = getattr(loss_function, CONFIG_ATTRIBUTE, None)
    if wrapped_config is not None:
        return wrapped_config
    if not isinstance(loss_function, functools.partial):
        return None
    func = loss_function.func
    if getattr(func, "__name__", "") != "ppo_loss" or "config" not in loss_function.keywords:
        return None  # value_loss, distillation losses, ...: never filtered
    return loss_function.keywords["config"]


def _padded(t: Any) -> Any:
    return t.to_padded_tensor(0) if getattr(t, "is_nested", False) else t


def advantages_and_mask(data: Any) -> tuple[Any, Any]:
    """``data``'s advantages (per token, broadcast from per row) and response mask, padded ``[B, R]``."""
    adv, mask = _padded(data["advantages"]), _padded(data["response_mask"])
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(mask)
    return adv, mask
