"""The old-logprob pass on provably on-policy updates (option ``logprob_skip``): trainer side,
and the 0.7.x legacy actor.

verl's trainer always runs the old-logprob pass (v0 ``RayPPOTrainer._compute_old_log_prob``,
0.9's v1 ``PPOTrainer._compute_old_log_prob``). The 0.7 legacy actor ignores its result when
the update is on-policy: one mini-batch and one epoch (``dp_actor.update_policy``:
``on_policy = len(mini_batches) == 1 and ppo_epochs == 1``, then ``old_log_prob =
log_prob.detach()``); the engine's ``ppo_loss`` (0.8+) always reads it, so there the worker
side (:mod:`.old_logprobs_engine`) makes the loss use the detached current log-probs. The decision is the ``grpo_recompute_old_logps``
hook's: the batch is consumed by ``mini-batches x epochs`` updates and the optimizer steps
after each one (a window of 1), and "needed elsewhere" covers every other reader of the
trainer's old log-probs (in-reward KL, rollout correction, rollout log-prob debug metrics,
``use_rollout_log_probs``, the sum_pi_squared baselines).

When skipped, the trainer gets a placeholder (:mod:`.placeholder`: a NaN no log-prob pass
produces, never zeros) for ``old_log_probs`` (and the entropies). The worker keys on it, not on
metadata: the legacy actor's ``update_policy`` wrapper checks that verl's own on-policy condition
holds for a batch whose old log-probs are all placeholder (or raises), and computes
``actor/entropy`` — which the trainer computes from that pass — from the training forward's own
logits (same weights: on-policy), aggregated over the whole batch exactly as the trainer does,
so the logged value stays verl's (not a placeholder). With the zero-advantage filter dropping
rows it is over the kept rows: ``actor/entropy/kept_rows``, and ``actor/entropy`` is NaN (not
computed). The pass is skipped only when the workers are known to substitute, and the update
after it must confirm that they did (:mod:`.skip_guarantee`).
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable

from grpo_patches import api

from . import metrics as verl_metrics
from . import placeholder
from .skip_guarantee import SUBSTITUTED, expect_substitution, workers_substitute

_ENTROPY: contextvars.ContextVar = contextvars.ContextVar("grpo_patches_verl_entropy", default=None)


def engine_on_policy(micro: Any) -> bool:
    """Whether the engine's loss uses the detached current log-probs as old ones for ``micro``."""
    from .old_logprobs_engine import active

    return active() is not None


def _get(config: Any, dotted: str, default: Any = None) -> Any:
    from .reference import _get as get

    return get(config, dotted, default)


def _consumptions(trainer: Any, batch: Any) -> int:
    """How many optimizer-step windows consume the batch: mini-batches x epochs (per GPU, as the worker splits)."""
    actor = trainer.config.actor_rollout_ref.actor
    n = int(_get(trainer.config, "actor_rollout_ref.rollout.n", 1))
    world = int(getattr(getattr(trainer, "actor_rollout_wg", None), "world_size", 1) or 1)
    sp = int(actor.get("ulysses_sequence_parallel_size", 1) or 1)
    dp = max(world // sp, 1)
    mini = max(int(actor.ppo_mini_batch_size) * n // dp, 1)
    rows = len(batch) // dp
    return -(-rows // mini) * int(actor.get("ppo_epochs", 1))


def _needed_elsewhere(trainer: Any, batch: Any) -> str | None:
    config = trainer.config
    actor = config.actor_rollout_ref.actor
    if _get(config, "algorithm.use_kl_in_reward", False):
        return "algorithm.use_kl_in_reward reads them"
    if _get(config, "algorithm.rollout_correction", None) is not None and "rollout_log_probs" in batch.batch.keys():
        return "rollout correction (algorithm.rollout_correction) reads them"
    if "rollout_log_probs" in batch.batch.keys():
        return "the rollout log-prob debug metrics read them"
    if actor.get("use_rollout_log_probs", False):
        return "actor.use_rollout_log_probs"
    if actor.get("calculate_sum_pi_squared", False):
        return "actor.calculate_sum_pi_squared (the optimal-token-baseline estimators)"
    if getattr(trainer, "use_legacy_worker_impl", "auto") == "disable" and not _engine_skip_available():
        return "the engine worker (use_legacy_worker_impl=disable) always reads them"
    return None


def _engine_skip_available() -> bool:
    """Whether this verl's engine worker has the worker-side records (the loss's substitute)."""
    from importlib import metadata

    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    from . import ENGINE_OLD_SKIP

    return Version(metadata.version("verl")) in SpecifierSet(ENGINE_OLD_SKIP)


def compute_old_log_prob(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``RayPPOTrainer._compute_old_log_prob(batch) -> (DataProto, mfu)``."""
    options = api.active_options("verl")
    batch = args[0] if args else kwargs["batch"]
    if options is None or not options.logprob_skip or instance is None:
        return wrapped(*args, **kwargs)
    from grpo_patches.plugins import hook
    from grpo_patches.recompute import explain

    consumptions = _consumptions(instance, batch)
    elsewhere = _needed_elsewhere(instance, batch)
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
    n = int(_get(trainer.config, "actor_rollout_ref.rollout.n", 1))
    mini = max(int(actor.ppo_mini_batch_size) * n, 1)  # global rows per mini-batch (all ranks)
    consumptions = -(-rows // mini) * int(actor.get("ppo_epochs", 1))
    compute = hook().grpo_recompute_old_logps(framework="verl", consumptions_left=consumptions, window_steps_left=1,
                                              needed_elsewhere=elsewhere is not None)
    why = explain(bool(compute) if compute is not None else True, consumptions, 1, elsewhere is not None)
    if compute is None:
        why = "a plugin deferred"
    api.note("verl", "old_logprob_pass", f"{why}{f' ({elsewhere})' if elsewhere else ''}", owner=trainer)
    return compute


def _v1_needed_elsewhere(trainer: Any) -> str | None:
    config = trainer.config
    if _get(config, "algorithm.use_kl_in_reward", False):
        return "algorithm.use_kl_in_reward reads them"
    correction = _get(config, "algorithm.rollout_correction", None)
    if correction is not None and any(_get(correction, k, None) for k in ("rollout_is", "rollout_rs", "bypass_mode")):
        return "rollout correction (algorithm.rollout_correction) reads them"
    if _get(config, "actor_rollout_ref.rollout.calculate_log_probs", False):
        return "the rollout log-prob debug metrics read them (rollout.calculate_log_probs)"
    if _get(config, "actor_rollout_ref.actor.calculate_sum_pi_squared", False):
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
    elsewhere = _v1_needed_elsewhere(instance)
    if _decide(instance, len(batch), elsewhere) is not False or not _workers_ready(instance):
        return wrapped(*args, **kwargs)
    from tensordict import TensorDict
    from verl.trainer.ppo.v1 import trainer_base

    tq = trainer_base.tq
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["response_mask"])
    mask = data["response_mask"]
    old = _nested_like(mask, placeholder.like(mask.values() if mask.is_nested else mask))
    batch = tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                            fields=TensorDict({"old_log_probs": old}, batch_size=data.batch_size))
    expect_substitution(instance)
    verl_metrics.report(None, old_logprob_passes_skipped=1)
    return batch


def _nested_like(mask: Any, values: Any) -> Any:
    """``values`` (one per element of ``mask``) in ``mask``'s layout (jagged rows when it is nested)."""
    if not getattr(mask, "is_nested", False):
        return values
    import torch

    return torch.nested.nested_tensor_from_jagged(values, offsets=mask.offsets())


def update_policy(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the legacy ``update_policy``: check the on-policy promise, log the real entropy."""
    data = args[0] if args else kwargs.get("data")
    if instance is None or data is None or "old_log_probs" not in data.batch.keys():
        return wrapped(*args, **kwargs)
    old = data.batch["old_log_probs"]
    if not placeholder.present(old):
        return wrapped(*args, **kwargs)
    config = instance.config
    mini_batches = -(-len(data) // config.ppo_mini_batch_size)
    if not placeholder.fills(old) or mini_batches != 1 or config.ppo_epochs != 1 \
            or config.get("use_rollout_log_probs", False):
        raise placeholder.PlaceholderError(
            f"grpo_patches: the old-logprob pass was skipped but this update is not on-policy ({len(data)} rows, "
            f"ppo_mini_batch_size={config.ppo_mini_batch_size}, ppo_epochs={config.ppo_epochs}, old log-probs all "
            f"placeholder: {placeholder.fills(old)}); nothing was trained. Please report this and {placeholder.FIX}"
        )
    captured: list = []
    token = _ENTROPY.set(captured)
    try:
        out = wrapped(*args, **kwargs)
    finally:
        _ENTROPY.reset(token)
    _log_entropy(out, config, data, captured)
    out[SUBSTITUTED] = 1.0  # verl's own on-policy path used the current log-probs: the trainer checks this
    verl_metrics.report(None, old_logprob_substituted_updates=1)
    return out


def forward_micro_batch(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``_forward_micro_batch``: also compute the entropy of the training forward."""
    captured = _ENTROPY.get()
    if captured is None:
        return wrapped(*args, **kwargs)
    micro = args[0] if args else kwargs["micro_batch"]
    if len(args) > 2:
        args = (*args[:2], True, *args[3:])
    else:
        kwargs = {**kwargs, "calculate_entropy": True}
    out = wrapped(*args, **kwargs)
    entropy = out["entropys"] if isinstance(out, dict) else out[0]
    rows = micro["advantages"].shape[0]
    captured.append((entropy.detach(), micro["response_mask"], rows))
    return out


def _log_entropy(out: dict, config: Any, data: Any, captured: list) -> None:
    """``actor/entropy`` over the whole batch (all DP ranks), as the trainer aggregates it."""
    import torch
    import torch.distributed as dist
    from verl.trainer.ppo.core_algos import agg_loss

    out.pop("actor/entropy", None)  # the per-micro-batch entropy a calculate_entropy config logs stays verl's below
    if not captured:
        return
    entropy = torch.cat([e for e, _, _ in captured])
    mask = torch.cat([m for _, m, _ in captured])
    complete = sum(r for _, _, r in captured) == len(data)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        entropy, mask = _gather(entropy), _gather(mask)
        flags = torch.tensor([int(complete)])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        complete = bool(flags.item())
    value = agg_loss(loss_mat=entropy, loss_mask=mask, loss_agg_mode=config.loss_agg_mode,
                     loss_scale_factor=config.get("loss_scale_factor", None)).item()
    if complete:
        out["actor/entropy"] = value
    else:  # the zero-advantage filter left rows out of the forward
        out["actor/entropy"] = float("nan")
        out["actor/entropy" + verl_metrics.KEPT_ROWS] = value


def _gather(t: Any, group: Any = None) -> Any:
    """All ranks' rows (ranks may hold different row counts after the filter)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    sizes = [None] * world
    dist.all_gather_object(sizes, int(t.shape[0]), group=group)
    padded = torch.zeros((max(sizes), *t.shape[1:]), dtype=t.dtype)
    padded[: t.shape[0]] = t
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])
