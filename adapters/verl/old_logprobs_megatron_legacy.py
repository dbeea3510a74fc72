"""The old-logprob skip on verl's 0.7.x legacy Megatron worker (worker side; :mod:`.old_logprobs`).

Unlike the 0.7 ``dp_actor``, ``MegatronPPOActor``'s loss always reads ``old_log_probs``, so a
skipped pass needs a substitution here:

* ``ActorRolloutRefWorker.update_actor`` (``verl.workers.megatron_workers``, wrapped): on old
  log-probs that are all placeholder (:mod:`.placeholders`), checks that the update is on-policy
  (one mini-batch of this data-parallel rank's rows, one epoch, no ``use_rollout_log_probs``;
  else it raises before anything is trained: every rank and pipeline stage sees the same batch),
  runs it with the substitution on, and reports it (``grpo_patches/old_log_probs_substituted``,
  checked by the trainer: :mod:`.skip_guarantee`).
* ``get_policy_loss_fn`` (``megatron_actor``'s binding): during such an update, the policy loss
  gets the detached current log-probs as the old ones, which is what verl's own pass would have
  computed with the same weights (one mini-batch: no optimizer step in between).

``actor/entropy``: the trainer's value comes from the skipped pass and is NaN (not computed);
this worker's update does not compute entropies unless ``entropy_coeff`` is set. The update
substitutes while ``UpdateCall.on_policy`` is set (:mod:`.state`; the tiled loss reads it too).
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import bind

from . import metrics as verl_metrics
from . import placeholders, state
from .skip_guarantee import SUBSTITUTED


def update_actor(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the legacy Megatron ``ActorRolloutRefWorker.update_actor(data) -> DataProto``."""
    data = placeholders.skipped_pass_batch(bind(wrapped, args, kwargs)["data"]) if instance is not None else None
    if data is None:
        return wrapped(*args, **kwargs)
    # ppo_mini_batch_size: this data-parallel rank's rows (verl divided it)
    placeholders.require_on_policy(data, instance.actor.config, "this Megatron update")
    with state.in_update(on_policy=state.OnPolicyUpdate()):
        output = wrapped(*args, **kwargs)
    output.meta_info["metrics"][SUBSTITUTED] = 1.0
    verl_metrics.report(None, old_logprob_substituted_updates=1)
    return output


def get_policy_loss_fn(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``megatron_actor.get_policy_loss_fn``: during a substituting update, the policy
    loss reads the detached current log-probs where the placeholder is."""
    fn = wrapped(*args, **kwargs)
    if state.update().on_policy is None:
        return fn

    def substituted(*a: Any, **kw: Any) -> Any:
        old = kw.get("old_log_prob")
        if old is not None and placeholders.fills(old):
            kw = {**kw, "old_log_prob": kw["log_prob"].detach()}
        return fn(*a, **kw)

    return substituted

