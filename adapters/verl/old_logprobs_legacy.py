"""The old-logprob skip on verl's 0.7.x legacy ``DataParallelPPOActor`` (worker side; :mod:`.old_logprobs`).

The 0.7 legacy actor ignores old log-probs on an on-policy update (one mini-batch, one epoch:
``old_log_prob = log_prob.detach()``), so a skipped pass needs no substitution here, only
proof and a metric:

* ``update_policy`` (wrapped): on old log-probs that are all placeholder
  (:mod:`.placeholders`), checks that verl's own on-policy condition holds (or raises), logs
  ``actor/entropy`` — which the trainer computes from the skipped pass — from the training
  forward's own logits (same weights: on-policy), aggregated over the whole batch exactly as
  the trainer does, so the logged value stays verl's (not a placeholder), and reports the
  substitution the trainer checks (:mod:`.skip_guarantee`). With the zero-advantage filter
  dropping rows the entropy is over the kept rows: ``actor/entropy/kept_rows``, and
  ``actor/entropy`` is NaN (not computed).
* ``_forward_micro_batch`` (wrapped): asks the training forward for its entropies, kept in
  ``UpdateCall.on_policy`` (:mod:`.state`).
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import bind

from . import metrics as verl_metrics
from . import placeholders, state
from .skip_guarantee import SUBSTITUTED


def update_policy(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the legacy ``update_policy``: check the on-policy promise, log the real entropy."""
    data = placeholders.skipped_pass_batch(bind(wrapped, args, kwargs)["data"]) if instance is not None else None
    if data is None:
        return wrapped(*args, **kwargs)
    config = instance.config
    placeholders.require_on_policy(data, config)
    update = state.OnPolicyUpdate()
    with state.in_update(on_policy=update):
        out = wrapped(*args, **kwargs)
    _log_entropy(out, config, data, update)
    out[SUBSTITUTED] = 1.0  # verl's own on-policy path used the current log-probs: the trainer checks this
    verl_metrics.report(None, old_logprob_substituted_updates=1)
    return out


def forward_micro_batch(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``_forward_micro_batch``: also compute the entropy of the training forward."""
    update = state.update().on_policy
    if update is None:
        return wrapped(*args, **kwargs)
    call = bind(wrapped, args, kwargs)
    micro = call["micro_batch"]
    out = call.call(wrapped, calculate_entropy=True)
    entropy = out["entropys"] if isinstance(out, dict) else out[0]
    update.entropy.append((entropy.detach(), micro["response_mask"]))
    update.rows_seen += micro["advantages"].shape[0]
    return out


def _log_entropy(out: dict, config: Any, data: Any, update: state.OnPolicyUpdate) -> None:
    """``actor/entropy`` over the whole batch (all DP ranks), as the trainer aggregates it."""
    import torch
    import torch.distributed as dist
    from verl.trainer.ppo.core_algos import agg_loss

    out.pop("actor/entropy", None)  # the per-micro-batch entropy a calculate_entropy config logs stays verl's below
    if not update.entropy:
        return
    entropy = torch.cat([e for e, _ in update.entropy])
    mask = torch.cat([m for _, m in update.entropy])
    complete = update.rows_seen == len(data)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        entropy, mask = verl_metrics.gather_rows(entropy), verl_metrics.gather_rows(mask)
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
