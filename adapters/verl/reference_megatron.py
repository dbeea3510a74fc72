"""The reference pass at KL coefficient 0 on verl's Megatron workers (option ``logprob_skip``; :mod:`.reference`).

* the Megatron engine (0.8+): ``MegatronEngine.forward_backward_batch`` runs verl's ``ppo_loss`` as the
  FSDP engine does, so the FSDP engine's wrapper (:func:`.reference.forward_backward_batch`: the loss
  with the KL loss off) runs unchanged on every pipeline stage (the stages before the last return ``{}``);
* the legacy Megatron worker (0.6.1-0.7.x): ``ActorRolloutRefWorker.update_actor``, where
  ``MegatronPPOActor`` selects its batch's keys and computes its loss (it reads
  ``self.config.use_kl_loss`` in both), runs with the KL loss off.
"""

from __future__ import annotations

from typing import Any, Callable

from . import reference
from .megatron_stages import on_every_stage


def forward_backward_batch(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``MegatronEngine.forward_backward_batch``: :func:`.reference.forward_backward_batch`
    on every pipeline stage."""
    return on_every_stage(reference.forward_backward_batch, wrapped, instance, args, kwargs)


def update_actor(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the legacy Megatron ``ActorRolloutRefWorker.update_actor(data) -> DataProto``: without
    reference log-probs (KL coefficient 0), the update runs with the KL loss off."""
    return reference.legacy_update_without_kl_loss(wrapped, getattr(instance, "actor", None), args, kwargs,
                                                   lambda output: output.meta_info["metrics"])
