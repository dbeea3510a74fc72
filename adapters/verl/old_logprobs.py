"""The old-logprob pass on provably on-policy updates (option ``logprob_skip``): the trainer side.

verl's trainer always runs the old-logprob pass (v0 ``RayPPOTrainer._compute_old_log_prob``,
0.9's v1 ``PPOTrainer._compute_old_log_prob``). The 0.7 legacy actor ignores its result when
the update is on-policy: one mini-batch and one epoch (``dp_actor.update_policy``:
``on_policy = len(mini_batches) == 1 and ppo_epochs == 1``, then ``old_log_prob =
log_prob.detach()``); the engine's ``ppo_loss`` (0.8+) always reads it, so there the worker
side makes the loss use the detached current log-probs. The decision is the
``grpo_recompute_old_logps`` hook's: the batch is consumed by ``mini-batches x epochs`` updates
and the optimizer steps after each one (a window of 1), and "needed elsewhere" covers every
other reader of the trainer's old log-probs (in-reward KL, rollout correction, rollout
log-prob debug metrics, ``use_rollout_log_probs``, the sum_pi_squared baselines).

When skipped, the trainer gets a placeholder (:mod:`.placeholder`: a NaN no log-prob pass
produces, never zeros) for ``old_log_probs`` (and the entropies). The worker keys on it, not
on metadata, checks that its update is on-policy (or raises) and logs ``actor/entropy`` from
the training forward: :mod:`.old_logprobs_legacy` (the 0.7.x ``DataParallelPPOActor``),
:mod:`.old_logprobs_engine` (the engine worker, 0.8+). The pass is skipped only when the
workers are known to substitute, and the update after it must confirm that they did
(:mod:`.skip_guarantee`).
"""
from __future__ import annotations

from typing import Any, Callable

from grpo_patches import api

from . import metrics as verl_metrics
from . import placeholder
from .config_value import config_value
from .skip_guarantee import expect_substitution, workers_substitute
from .version import engine_skip_available


def _consumptions(trainer: Any, batch: Any) -> int:
    """How many optimizer-step windows consume the batch: mini-batches x epochs (per GPU, as the worker splits)."""
    actor = trainer.config.actor_rollout_ref.actor
    n = int(config_value(trainer.config, "actor_rollout_ref.rollout.n", 1))
    world = int(getattr(getattr(trainer, "actor_rollout_wg", None), "world_size", 1) or 1)
    sp = int(actor.get("ulysses_sequence_parallel_size", 1) or 1)
    dp = max(world // sp, 1)
    mini = max(int(actor.ppo_mini_batch_size) * n // dp, 1)
    rows = len(batch) // dp
    return -(-rows // mini) * int(actor.get("ppo_epochs", 1))


def needed_elsewhere(trainer: Any, batch: Any) -> str | None:
    config = trainer.config
    actor = config.actor_rollout_ref.actor
    if config_value(config, "algorithm.use_kl_in_reward", False):
        return "algorithm.use_kl_in_reward reads them"
    if config_value(config, "algorithm.rollout_correction", None) is not None and "rollout_log_probs" in batch.batch.keys():
        return "rollout correction (algorithm.rollout_correction) reads them"
    if "rollout_log_probs" in batch.batch.keys():
        return "the rollout log-prob debug metrics read them"
    if actor.get("use_rollout_log_probs", False):
        return "actor.use_rollout_log_probs"
    if actor.get("calculate_sum_pi_squared", False):
        return "actor.calculate_sum_pi_squared (the optimal-token-baseline estimators)"
    if getattr(trainer, "use_legacy_worker_impl", "auto") == "disable" and not engine_skip_available():
        return "the engine worker (use_legacy_worker_impl=disable) always reads them"
    return None


def compute_old_log_prob(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``RayPPOTrainer._compute_old_log_prob(batch) -> (DataProto, mfu)``."""
    options = api.active_options("verl")
    batch = args[0] if args else kwargs["batch"]
    if options is None or not options.logprob_skip or instance is None:
        return wrapped(*args, **kwargs)
    from grpo_patches.plugins import hook
    from grpo_patches.recompute import explain

    consumptions = _consumptions(instance, batch)
    elsewhere = needed_elsewhere(instance, batch)
    compute = hook().grpo_recompute_old_logps(framework="verl", consumptions_left=consumptions, window_steps_left=1,
                                              needed_elsewhere=elsewhere is not None)
    if compute is None or compute:
        why = explain(True, consumptions, 1, elsewhere is not None) if compute is not None else "a plugin deferred"
        api.note("verl", "old_logprob_pass", f"{why}{f' ({elsewhere})' if elsewhere else ''}", owner=instance)
        return wrapped(*args, **kwargs)
    if not _workers_ready(instance):
        return wrapped(*args, **kwargs)
    from verl import DataProto

    mask = batch.batch["response_mask"]
    skipped = DataProto.from_dict(tensors={
        "old_log_probs": placeholder.like(mask),  # the worker substitutes the current log-probs
        "entropys": placeholder.like(mask),  # trainer's actor/entropy (NaN): the actor logs the real one
    })
    expect_substitution(instance)
    api.note("verl", "old_logprob_pass", explain(False, consumptions, 1, False), owner=instance)
    verl_metrics.report(None, old_logprob_passes_skipped=1)
    return skipped, float("nan")  # perf/mfu/actor_infer: no pass ran (not a 0 placeholder)


def _workers_ready(trainer: Any) -> bool:
    """Whether the processes that update ``trainer``'s actor substitute a skipped pass (else a note: it runs)."""
    why = workers_substitute(trainer)
    if why is not None:
        api.note("verl", "old_logprob_pass", f"computed: the skip needs the workers' substitution, and {why}",
                 owner=trainer)
    return why is None


def _decide(trainer: Any, rows: int, elsewhere: str | None) -> bool | None:
    """The hook's answer for a batch of ``rows`` (``True``: compute, ``False``: skip, ``None``: deferred)."""
    from grpo_patches.plugins import hook
    from grpo_patches.recompute import explain

    actor = trainer.config.actor_rollout_ref.actor
    n = int(config_value(trainer.config, "actor_rollout_ref.rollout.n", 1))
    mini = max(int(actor.ppo_mini_batch_size) * n, 1)  # global rows per mini-batch (all ranks)
    consumptions = -(-rows // mini) * int(actor.get("ppo_epochs", 1))
    compute = hook().grpo_recompute_old_logps(framework="verl", consumptions_left=consumptions, window_steps_left=1,
                                              needed_elsewhere=elsewhere is not None)
    why = explain(bool(compute) if compute is not None else True, consumptions, 1, elsewhere is not None)
    if compute is None:
        why = "a plugin deferred"
    api.note("verl", "old_logprob_pass", f"{why}{f' ({elsewhere})' if elsewhere else ''}", owner=trainer)
    return compute


def v1_needed_elsewhere(trainer: Any) -> str | None:
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


def compute_old_log_prob_v1(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of 0.9's v1 ``PPOTrainer._compute_old_log_prob(batch, metrics) -> batch``.

    Skipped: ``old_log_probs`` in the TransferQueue is the placeholder, which the worker replaces
    by the current log-probs however the batch travels between the trainer's stages (no marker:
    verl's later ``kv_batch_put`` calls return fresh metadata); no ``entropy`` field and no
    ``actor/entropy`` metric here: the actor's update logs ``actor/entropy`` from its own forward."""
    options = api.active_options("verl")
    if options is None or not options.logprob_skip or instance is None:
        return wrapped(*args, **kwargs)
    batch = args[0] if args else kwargs["batch"]
    elsewhere = v1_needed_elsewhere(instance)
    if _decide(instance, len(batch), elsewhere) is not False or not _workers_ready(instance):
        return wrapped(*args, **kwargs)
    from tensordict import TensorDict
    from verl.trainer.ppo.v1 import trainer_base

    tq = trainer_base.tq
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["response_mask"])
    mask = data["response_mask"]
    old = nested_like(mask, placeholder.like(mask.values() if mask.is_nested else mask))
    batch = tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                            fields=TensorDict({"old_log_probs": old}, batch_size=data.batch_size))
    expect_substitution(instance)
    verl_metrics.report(None, old_logprob_passes_skipped=1)
    return batch


def nested_like(mask: Any, values: Any) -> Any:
    """``values`` (one per element of ``mask``) in ``mask``'s layout (jagged rows when it is nested)."""
    if not getattr(mask, "is_nested", False):
        return values
    import torch

    return torch.nested.nested_tensor_from_jagged(values, offsets=mask.offsets())
