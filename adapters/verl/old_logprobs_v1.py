"""The old-logprob pass on provably on-policy updates (option ``logprob_skip``) on verl 0.9's V1 trainer
(``PPOTrainer``, TransferQueue; the legacy ``RayPPOTrainer``'s: :mod:`.old_logprobs`).

The V1 trainer passes data by keys: ``_compute_old_log_prob`` writes each key's ``old_log_probs``
into TransferQueue. Skipped, it writes the placeholder instead, which the worker replaces by the
current log-probs however the batch travels between the trainer's stages (no marker: verl's later
``kv_batch_put`` calls return fresh metadata); no ``entropy`` field and no ``actor/entropy`` metric
here: the actor's update logs ``actor/entropy`` from its own forward. The decision counts the
batch's global mini-batches x epochs; ``_update_actor`` checks that the workers confirmed.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import bind

from . import FRAMEWORK
from . import metrics as verl_metrics
from . import placeholders, skip_guarantee
from .config_value import config_value
from .old_logprobs import decide, workers_ready


def needed_elsewhere(trainer: Any) -> str | None:
    """What else reads the V1 trainer's old log-probs (the pass then runs), or ``None``."""
    config = trainer.config
    if config_value(config, "algorithm.use_kl_in_reward", False):
        return "algorithm.use_kl_in_reward reads them"
    correction = config_value(config, "algorithm.rollout_correction", None)
    if correction is not None and any(config_value(correction, k, None) for k in ("rollout_is", "rollout_rs", "bypass_mode")):
        return "rollout correction (algorithm.rollout_correction) reads them"
    if config_value(config, "actor_rollout_ref.rollout.calculate_log_probs", False):
        return "the rollout log-prob debug metrics read them (rollout.calculate_log_probs)"
    if config_value(config, "actor_rollout_ref.actor.calculate_sum_pi_squared", False):
        return "actor.calculate_sum_pi_squared (the optimal-token-baseline estimators)"
    return None


def _consumptions(trainer: Any, rows: int) -> int:
    """The batch's optimizer-step windows: global mini-batches (all ranks) x epochs."""
    actor = trainer.config.actor_rollout_ref.actor
    n = int(config_value(trainer.config, "actor_rollout_ref.rollout.n", 1))
    mini = max(int(actor.ppo_mini_batch_size) * n, 1)  # global rows per mini-batch (all ranks)
    return -(-rows // mini) * int(actor.get("ppo_epochs", 1))


def compute_old_log_prob(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of 0.9's V1 ``PPOTrainer._compute_old_log_prob(batch, metrics) -> KVBatchMeta``."""
    if not FRAMEWORK.on("logprob_skip") or instance is None:
        return wrapped(*args, **kwargs)
    batch = bind(wrapped, args, kwargs)["batch"]
    if decide(instance, _consumptions(instance, len(batch)), needed_elsewhere(instance)) is not False \
            or not workers_ready(instance):
        return wrapped(*args, **kwargs)
    from tensordict import TensorDict
    from verl.trainer.ppo.v1 import trainer_base

    tq = trainer_base.tq
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["response_mask"])
    mask = data["response_mask"]
    old = nested_like(mask, placeholders.like(mask.values() if mask.is_nested else mask))
    batch = tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                            fields=TensorDict({"old_log_probs": old}, batch_size=data.batch_size))
    skip_guarantee.expect_substitution(instance)
    verl_metrics.report(None, old_logprob_passes_skipped=1)
    return batch


def update_actor(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the V1 trainer's ``PPOTrainer._update_actor(batch, metrics)`` (it fills ``metrics``):
    the update after a skipped pass must confirm the substitution (:func:`.skip_guarantee.confirm`)."""
    if instance is None:
        return wrapped(*args, **kwargs)
    expected = skip_guarantee.take_expected(instance)
    metrics = bind(wrapped, args, kwargs)["metrics"]
    output = wrapped(*args, **kwargs)
    skip_guarantee.confirm(expected, metrics)
    return output


def nested_like(mask: Any, values: Any) -> Any:
    """``values`` (one per element of ``mask``) in ``mask``'s layout (jagged rows when it is nested)."""
    if not getattr(mask, "is_nested", False):
        return values
    import torch

    return torch.nested.nested_tensor_from_jagged(values, offsets=mask.offsets())
