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

When skipped, the trainer gets a placeholder (:mod:`.placeholders`: a NaN no log-prob pass
produces, never zeros) for ``old_log_probs`` (and the entropies). The worker keys on it, not
on metadata, checks that its update is on-policy (or raises) and logs ``actor/entropy`` from
the training forward: :mod:`.old_logprobs_legacy` (the 0.7.x ``DataParallelPPOActor``),
:mod:`.old_logprobs_engine` (the engine worker, 0.8+). The pass is skipped only when the
workers are known to substitute, and the update after it must confirm that they did
(:mod:`.skip_guarantee`; :func:`update_actor`). The V1 trainer's: :mod:`.old_logprobs_v1`.
"""
from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import bind

from . import FRAMEWORK
from . import metrics as verl_metrics
from . import placeholders, skip_guarantee
from .config_value import config_value
from .version import engine_skip_available

NOTE = "old_logprob_pass"


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
    if not FRAMEWORK.on("logprob_skip") or instance is None:
        return wrapped(*args, **kwargs)
    batch = bind(wrapped, args, kwargs)["batch"]
    if decide(instance, _consumptions(instance, batch), needed_elsewhere(instance, batch)) is not False \
            or not workers_ready(instance):
        return wrapped(*args, **kwargs)
    from verl import DataProto

    mask = batch.batch["response_mask"]
    skipped = DataProto.from_dict(tensors={
        "old_log_probs": placeholders.like(mask),  # the worker substitutes the current log-probs
        "entropys": placeholders.like(mask),  # trainer's actor/entropy (NaN): the actor logs the real one
    })
    skip_guarantee.expect_substitution(instance)
    verl_metrics.report(None, old_logprob_passes_skipped=1)
    return skipped, float("nan")  # perf/mfu/actor_infer: no pass ran (not a 0 placeholder)


def workers_ready(trainer: Any) -> bool:
    """Whether the processes that update ``trainer``'s actor substitute a skipped pass (else a note: it runs)."""
    why = skip_guarantee.workers_substitute(trainer)
    if why is not None:
        FRAMEWORK.note(NOTE, f"computed: the skip needs the workers' substitution, and {why}", owner=trainer)
    return why is None


def decide(trainer: Any, consumptions: int, elsewhere: str | None) -> bool | None:
    """The ``grpo_recompute_old_logps`` hook's answer for a batch consumed by ``consumptions`` optimizer-step
    windows (``True``: compute, ``False``: skip, ``None``: a plugin deferred), noted in ``status()``."""
    from grpo_patches.plugins import hook
    from grpo_patches.recompute import explain

    compute = hook().grpo_recompute_old_logps(framework=FRAMEWORK.name, consumptions_left=consumptions,
                                              window_steps_left=1, needed_elsewhere=elsewhere is not None)
    why = explain(bool(compute) if compute is not None else True, consumptions, 1, elsewhere is not None)
    if compute is None:
        why = "a plugin deferred"
    FRAMEWORK.note(NOTE, f"{why}{f' ({elsewhere})' if elsewhere else ''}", owner=trainer)
    return compute


def update_actor(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the legacy trainer's ``RayPPOTrainer._update_actor(batch) -> DataProto``: the update
    after a skipped pass (or the minimal pass's skipped rows) must confirm the substitution
    (:func:`.skip_guarantee.confirm`)."""
    if instance is None:
        return wrapped(*args, **kwargs)
    expected = skip_guarantee.take_expected(instance)
    output = wrapped(*args, **kwargs)
    skip_guarantee.confirm(expected, getattr(output, "meta_info", {}).get("metrics", {}))
    return output
