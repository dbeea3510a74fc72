"""verl's policy loss around the tiled lm-head loss (option ``tiled_loss``; :mod:`.tiled`).

``get_policy_loss_fn`` (wrapped: the binding verl's loss code calls, dp_actor or
``verl.workers.utils.losses``) hands verl a policy-loss function that runs verl's own on the
detached log-probs the tiled forward returned (so every metric, and the loss value, is
verl's) and returns ``tiled - tiled.detach() + verl's value``: verl's value, the tiled loss's
gradient. Before that it checks that verl's loss received exactly the inputs the tiled loss
used (else a clear error: verl's internals moved). A micro-batch whose forward did not
compute the tiled loss keeps verl's own loss (refused for ``tiled_loss=True``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from grpo_patches.verify_fp32_head import tiled_aside

from . import state, tiled


def get_policy_loss_fn(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``get_policy_loss_fn(name)`` as bound by verl's loss code (dp_actor, losses)."""
    fn = wrapped(*args, **kwargs)
    call = pending()
    if call is None:
        return fn
    return functools.partial(_tiled_policy_loss, fn, call)


def pending() -> state.TiledCall | None:
    """The micro-batch's call the policy loss is for: the legacy actor's last forward's (its loss runs
    after the forward returned: ``TiledUpdate.pending``), else the one running (``MicroBatchCall.tiled``)."""
    update = state.update().tiled
    if update is not None and update.pending:
        return update.pending[-1]
    return state.micro_batch().tiled


def _tiled_policy_loss(fn: Callable[..., Any], call: state.TiledCall, *args: Any, **kwargs: Any) -> Any:
    update = state.update().tiled
    if update is not None and update.pending and update.pending[-1] is call:
        update.pending.pop()
    pg_loss, metrics = fn(*args, **kwargs)
    if call.loss is None:  # verl's own forward ran (with its gradient): nothing to replace
        if not tiled_aside():  # (verify mode's reference of the tiled loss: no decline)
            tiled.decline(call.owner, call.declined or "verl's forward did not call FusedLinearForPPO", "a micro-batch")
        return pg_loss, metrics
    _check_inputs(call, kwargs)
    # verl's value, the tiled loss's gradient, and (exactly 0) a path through the model's output
    # log-probs, so FSDP's pre-backward hook on the forward's outputs fires (see _anchored)
    log_prob, mask = kwargs["log_prob"], kwargs["response_mask"] != 0
    through_output = (log_prob[mask] * 0.0).sum() if log_prob.requires_grad else 0.0
    return call.loss - call.loss.detach() + pg_loss.detach() + through_output, metrics


def _check_inputs(call: state.TiledCall, got: dict) -> None:
    """verl's policy loss must see exactly what the tiled loss used (else its internals moved)."""
    import torch

    rows = call.rows
    mask_loss = got["response_mask"]
    device = call.logps.device

    def at(value: Any) -> Any:
        value = value.to(device)
        return value if rows is None else value[rows.to(device)]

    mask = at(mask_loss) != 0
    problems = []
    if not torch.equal(mask, call.used["response_mask"].to(device) != 0):
        problems.append("response_mask")
    else:
        if not torch.equal(at(got["log_prob"])[mask].float(), call.logps[mask]):
            problems.append("log_prob (not the tiled loss's)")
        old = call.used.get("old_log_probs")
        expected = call.logps if old is None else old.to(device).float()
        if not torch.equal(at(got["old_log_prob"])[mask].float(), expected[mask]):
            problems.append("old_log_prob" + (" (verl's update is not on-policy)" if old is None else ""))
        if not torch.equal(at(got["advantages"])[mask].float(), call.used["advantages"].to(device)[mask].float()):
            problems.append("advantages")
        is_weights, used = got.get("rollout_is_weights"), call.used.get("rollout_is_weights")
        if (is_weights is None) != (used is None) or (
                used is not None and not torch.equal(at(is_weights)[mask].float(), used.to(device)[mask].float())):
            problems.append("rollout_is_weights")
        weights = tiled.token_weights(mask_loss, got["loss_agg_mode"], tiled.global_batch_info(call.config))
        if got["loss_agg_mode"] != call.loss_agg_mode or not torch.equal(weights.to(device), call.weights.to(device)):
            problems.append("the loss aggregation (loss_agg_mode / global token and row counts)")
    if problems:
        raise RuntimeError(
            "grpo_patches: verl's policy loss received a different " + ", ".join(problems)
            + " than the tiled loss used (verl's internals moved?); pass tiled_loss=False to grpo_patches.enable(...)"
        )
