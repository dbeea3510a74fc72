"""The tiled lm-head loss on verl's Megatron backends: not applied yet, never silently (the engine,
0.8.0+, and the legacy ``MegatronPPOActor``, 0.6.1-0.7.x).

verl's Megatron engine computes log-probs from Megatron's own output layer (vocabulary-parallel
logits under tensor parallelism, ``patch_fused_forward`` for its fused kernels), a path the
tiled loss does not answer yet. ``tiled_loss="auto"`` keeps verl's own loss and says so in
``status()`` (per engine); ``tiled_loss=True`` raises one clear error before the first update.
"""

from __future__ import annotations

from typing import Any, Callable

from . import tiled
from .engine_calls import actor_config_of, forward_backward_arguments


def reason(engine: Any, what: str = "verl's Megatron engine") -> str:
    """Why the tiled loss does not apply (``engine``: anything with the Megatron settings as ``engine_config``)."""
    tp = int(getattr(engine.engine_config, "tensor_model_parallel_size", 1) or 1)
    if tp > 1:
        return (f"{what} with tensor parallelism ({tp}) splits the vocabulary over ranks; the tiled "
                "loss does not compute vocabulary-parallel log-probs yet")
    return f"{what} computes log-probs through Megatron's output layer, which the tiled loss does not answer yet"


def forward_backward_batch(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``MegatronEngine.forward_backward_batch``: decides (once per engine) and notes."""
    _, loss_function, forward_only = forward_backward_arguments(*args, **kwargs)
    if instance is not None and not forward_only and actor_config_of(loss_function) is not None and tiled.enabled():
        tiled.decide(instance, [reason(instance)])  # refuse-or-note
    return wrapped(*args, **kwargs)


def update_policy(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the legacy ``MegatronPPOActor.update_policy``: decides (once per actor) and notes."""
    if instance is not None and getattr(instance, "actor_optimizer", None) is not None and tiled.enabled():
        import types

        view = types.SimpleNamespace(engine_config=instance.config.megatron)
        tiled.decide(instance, [reason(view, "verl's legacy Megatron actor")])  # refuse-or-note
    return wrapped(*args, **kwargs)
