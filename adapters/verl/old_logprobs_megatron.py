"""The old-logprob pass on on-policy updates, worker side of verl's Megatron engine (0.8+; :mod:`.old_logprobs_engine`).

The Megatron engine computes the same ``ppo_loss`` as the FSDP engine, from Megatron's pipeline
schedule: its loss function is called per micro-batch (``postprocess_micro_batch_func``, last
stage), not from a ``forward_step`` of the engine's own. So the record that keeps each training
micro-batch's entropies for ``actor/entropy`` wraps the loss function where the engine receives
it, ``MegatronEngine.forward_backward_batch(data, loss_function, forward_only)``; the update's
check and ``get_policy_loss_fn``'s substitution are the FSDP engine's records (the worker and the
losses module are shared).
"""

from __future__ import annotations

from typing import Any, Callable

from .old_logprobs_engine import collecting_entropies


def forward_backward_batch(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``MegatronEngine.forward_backward_batch``: keep each training micro-batch's entropies."""
    return collecting_entropies(wrapped, args, kwargs)
