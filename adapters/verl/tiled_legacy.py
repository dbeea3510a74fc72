"""Tiled lm-head loss on verl's legacy ``DataParallelPPOActor`` (0.6.1-0.7.x; :mod:`.tiled`).

* ``update_policy`` (wrapped, outside the zero-advantage filter): decides once per actor
  whether the tiled loss can reproduce its config, and whether this update is on-policy
  (verl's own rule: one mini-batch, one epoch, no ``use_rollout_log_probs``; then verl's
  loss uses ``log_prob.detach()`` as old log-probs, and so does the tiled loss).
* ``_forward_micro_batch`` (wrapped innermost, so it sees the micro-batch after the filter
  and the old-logprob skip adjusted it): describes the training micro-batch for the fused
  forward: response token ``j`` of row ``b`` is predicted at padded position
  ``(b, S - R - 1 + j)``, or at that position's index among the unpadded tokens
  (``use_remove_padding``: verl unpads by ``attention_mask``, row-major).
  ``dropped_rows_metrics=True``: the filter forwards the kept rows of a micro-batch with
  autograd (``MicroBatchCall.subset``); the call then covers those rows of the micro-batch verl's
  loss sees. verl calls its loss after the forward returned: the call waits in ``TiledUpdate.pending``.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import bind

from . import metrics as verl_metrics
from . import state, tiled
from .multimodal import has_multimodal_inputs


def _problems(actor: Any) -> list[str]:
    config = actor.config
    problems = tiled.config_problems(config, fused=bool(actor.use_fused_kernels), backend=tiled.fused_backend(
        actor.actor_module), sp=int(getattr(actor, "ulysses_sequence_parallel_size", 1) or 1))
    if (config.entropy_coeff or config.use_kl_loss) and dict(config.get("global_batch_info", None) or {}):
        problems.append("actor.global_batch_info is set (the entropy / KL terms of this verl divide differently)")
    return problems


def update_policy(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``DataParallelPPOActor.update_policy(data)``."""
    if instance is None or instance.actor_optimizer is None or not tiled.enabled():
        return wrapped(*args, **kwargs)
    if not tiled.decide(instance, _problems(instance)):
        return wrapped(*args, **kwargs)
    data = bind(wrapped, args, kwargs)["data"]
    if has_multimodal_inputs(data.non_tensor_batch.get("multi_modal_inputs")):
        tiled.decline(instance, "multimodal inputs (not tested with the tiled loss)")
        return wrapped(*args, **kwargs)
    config = instance.config
    mini_batches = -(-len(data) // config.ppo_mini_batch_size)
    on_policy = mini_batches == 1 and config.ppo_epochs == 1 and not config.get("use_rollout_log_probs", False)
    update = state.TiledUpdate(instance, on_policy)
    with state.in_update(tiled=update):
        out = wrapped(*args, **kwargs)
    verl_metrics.report(out, tiled_loss_micro_batches=update.calls)
    return out


def _positions(micro: dict) -> Callable[[tuple], Any]:
    import torch

    input_ids, attention_mask = micro["input_ids"], micro["attention_mask"]
    rows, width = input_ids.shape
    response = micro["responses"].shape[-1]
    padded = (torch.arange(rows)[:, None] * width + (width - response - 1) + torch.arange(response)[None, :])

    def positions(shape: tuple) -> Any:
        if shape == (rows, width):
            return padded
        kept = torch.nonzero(attention_mask.flatten().cpu()).flatten()  # verl's unpad order (row-major)
        if shape == (1, kept.numel()):
            index = torch.full((rows * width,), -1, dtype=torch.long)
            index[kept] = torch.arange(kept.numel())
            return index[padded]
        return None

    return positions


def forward_micro_batch(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``_forward_micro_batch(micro_batch, temperature, calculate_entropy)``."""
    import torch

    update = state.update().tiled
    if update is None or update.actor is not instance or not torch.is_grad_enabled():
        return wrapped(*args, **kwargs)
    call = bind(wrapped, args, kwargs)
    micro = call["micro_batch"]
    full, rows = state.micro_batch().subset or (micro, None)  # dropped_rows_metrics: some rows of ``full``
    config = instance.config

    def inputs() -> dict:
        return {"response_mask": micro["response_mask"], "advantages": micro["advantages"],
                "old_log_probs": None if update.on_policy else micro["old_log_probs"],
                "rollout_is_weights": micro.get("rollout_is_weights"), "ref_log_prob": micro.get("ref_log_prob")}

    tiled_call = state.TiledCall(
        owner=instance, config=config, inputs=inputs, positions=_positions(micro),
        weights=tiled.token_weights(full["response_mask"], config.loss_agg_mode, tiled.global_batch_info(config)),
        loss_agg_mode=config.loss_agg_mode, info=tiled.global_batch_info(config),
        calculate_entropy=bool(call["calculate_entropy"]), responses=micro["responses"], rows=rows)
    with state.in_micro_batch(tiled=tiled_call):
        out = wrapped(*args, **kwargs)
    update.pending.append(tiled_call)  # for verl's loss, called after the forward returns
    update.calls += tiled_call.loss is not None
    return out


def response_positions(micro: dict) -> Callable[[tuple], Any]:
    """Each response token's hidden-state index in the padded or unpadded layout (the Megatron legacy actor's too)."""
    return _positions(micro)
