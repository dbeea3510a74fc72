"""The tiled lm-head loss on verl's legacy Megatron actor (``MegatronPPOActor``, 0.6.1-0.7.x; :mod:`.tiled`).

With ``use_fused_kernels=True`` the legacy actor's ``forward_step`` (a closure of
``forward_backward_batch``) runs ``fused_forward_model``: the micro-batch packed
(``preprocess_packed_seqs``; no per-sequence padding with TP = CP = 1) and, in verl's patched
``GPTModel.forward``, one ``linear_cross_entropy(hidden [tokens, 1, H], output weight, labels, temperature,
"none", tp_group)`` call in place of the output layer's projection (answered by
:func:`.tiled_megatron.linear_cross_entropy`, as on the engine line). Its loss (``loss_func``, also a
closure) is verl's ``agg_loss`` over the micro-batch alone, as the legacy ``dp_actor``'s.

* ``update_policy`` (wrapped): decides once per actor (``tiled_loss=True`` refuses before the first
  micro-batch) and counts the micro-batches the tiled loss answered;
* ``get_forward_backward_func`` (``megatron_actor``'s binding, wrapped; inert outside such an update):
  the schedule it returns gets a training ``forward_step_func`` that describes each micro-batch in a
  :class:`~.state.TiledCall` (the positions of the legacy FSDP actor's padded layout, read from the
  packed one) and keeps it as ``MicroBatchCall.tiled`` for the forward and for the loss function the
  schedule calls after it;
* :mod:`.tiled_policy_loss` (the ``get_policy_loss_fn`` binding of ``megatron_actor``) hands verl's loss
  the tiled gradient with verl's value.

Tensor parallelism, context / pipeline parallelism, fp8, a vision model, MoE communication overlap, or
no fused kernels: ``"auto"`` keeps verl's own loss with the reason in ``status()``; ``True`` raises. So do tied
embeddings on 0.6.1, whose fused forward hands the kernel ``output_layer.weight`` (None when the output layer
shares the embedding's weight; 0.7 hands it the embedding's). 0.6.1 packs every micro-batch into THD, with or
without fused kernels; the fused forward packs as on 0.7 (``preprocess_packed_seqs``), so the positions are the same.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable

from . import metrics as verl_metrics
from . import state, tiled, tiled_megatron
from .tiled_legacy import response_positions


class _Settings:
    """The actor's Megatron settings, with the fused-kernel switch the actor itself resolved (MTP turns it off)."""

    def __init__(self, megatron: Any, **own: Any):
        self._megatron, self._own = megatron, own

    def __getattr__(self, name: str) -> Any:
        if name in self._own:
            return self._own[name]
        return getattr(self._megatron, name)


def problems(actor: Any) -> list[str]:
    """The settings of ``actor`` (a ``MegatronPPOActor``) the tiled loss cannot reproduce yet, each with its fix."""
    config = actor.config
    view = types.SimpleNamespace(
        engine_config=_Settings(config.megatron, use_fused_kernels=bool(getattr(actor, "use_fused_kernels", False))),
        tf_config=getattr(actor, "tf_config", None),
        model_config=types.SimpleNamespace(hf_config=getattr(actor, "hf_config", None)))
    found = tiled_megatron.problems(view, config)
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        found.append("overlap_moe_expert_parallel_comm=True (its 1F1B forward does not call the fused kernel; "
                     "use False)")
    if getattr(getattr(actor, "hf_config", None), "tie_word_embeddings", False) and _hands_none_when_tied():
        found.append("tie_word_embeddings=True with verl 0.6.1 (its fused Megatron forward hands the kernel "
                     "output_layer.weight, which is None when the output layer shares the embedding's weight; verl "
                     "0.7 hands it the embedding's: upgrade verl, or keep verl's loss)")
    if (config.entropy_coeff or config.use_kl_loss) and tiled.global_batch_info(config):
        found.append("actor.global_batch_info is set (the entropy / KL terms of this verl divide differently)")
    return found


def _hands_none_when_tied() -> bool:
    """Whether this verl's fused Megatron forward passes ``output_layer.weight`` as is (0.6.1; 0.7 added the
    embedding's weight for tied models)."""
    from packaging.version import Version

    from .version import installed

    return installed() < Version("0.7")


def update_policy(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``MegatronPPOActor.update_policy(dataloader)``."""
    if instance is None or getattr(instance, "actor_optimizer", None) is None or not tiled.enabled():
        return wrapped(*args, **kwargs)
    if not tiled.decide(instance, problems(instance)):  # refuse-or-note, before any micro-batch
        return wrapped(*args, **kwargs)
    update = state.TiledUpdate(instance)
    with state.in_update(tiled=update):
        out = wrapped(*args, **kwargs)
    verl_metrics.report(out if isinstance(out, dict) else None, tiled_loss_micro_batches=update.calls)
    return out


def get_forward_backward_func(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``get_forward_backward_func()`` as bound in ``megatron_actor``."""
    schedule = wrapped(*args, **kwargs)
    update = state.update().tiled
    if update is None:
        return schedule
    return functools.partial(_schedule, schedule, update)


def _schedule(schedule: Callable[..., Any], update: state.TiledUpdate, *args: Any, **kwargs: Any) -> Any:
    """Megatron's schedule, called by verl with keywords only; training: each micro-batch through the tiled loss."""
    step = kwargs.get("forward_step_func")
    if step is not None and not kwargs.get("forward_only", False):
        kwargs["forward_step_func"] = functools.partial(_forward_step, update, step)
    return schedule(*args, **kwargs)


def _forward_step(update: state.TiledUpdate, step: Callable[..., Any], batch_iter: Any, model: Any, *args: Any,
                  **kwargs: Any) -> Any:
    """verl's ``forward_step(batch_iter, model)`` with the micro-batch's call running; its loss function too."""
    micro = next(batch_iter)
    call = _call(update.actor, micro)
    with state.in_micro_batch(tiled=call):
        output, loss = step(iter([micro]), model, *args, **kwargs)
    if call is None:
        return output, loss
    return output, functools.partial(_loss_with_call, update, call, loss)


def _loss_with_call(update: state.TiledUpdate, call: state.TiledCall, loss: Callable[..., Any], *args: Any,
                    **kwargs: Any) -> Any:
    with state.in_micro_batch(tiled=call):
        out = loss(*args, **kwargs)
    update.calls += call.loss is not None
    return out


def _call(actor: Any, micro: Any) -> state.TiledCall | None:
    """One training micro-batch (verl's ``TensorDict``, padded ``[B, S]`` rows) of the legacy Megatron actor."""
    if "multi_modal_inputs" in micro.keys():
        tiled.decline(actor, "multimodal inputs (not tested with the tiled loss)")
        return None
    config = actor.config
    info = tiled.global_batch_info(config)
    mask = micro["response_mask"].to(bool)  # as verl's loss_func
    substituted = state.update().on_policy is not None  # the old-logprob skip: verl's loss gets the current ones

    def inputs() -> dict:
        return {"response_mask": mask, "advantages": micro["advantages"],
                "old_log_probs": None if substituted else micro["old_log_probs"],
                "rollout_is_weights": micro.get("rollout_is_weights", None),
                "ref_log_prob": micro.get("ref_log_prob", None)}

    return state.TiledCall(
        owner=actor, config=config, inputs=inputs, positions=_positions(response_positions(micro)),
        weights=tiled.token_weights(mask, config.loss_agg_mode, info), loss_agg_mode=config.loss_agg_mode,
        info=info, calculate_entropy=bool(config.entropy_coeff != 0),  # update_policy's rule
        responses=micro["responses"])


def _positions(padded: Callable[[tuple], Any]) -> Callable[[tuple], Any]:
    """Megatron's ``[tokens, 1]`` packed hidden states: the legacy FSDP actor's unpadded ``[1, tokens]``
    layout (``attention_mask``'s tokens, row-major), transposed (TP = CP = 1: no per-sequence padding)."""

    def positions(shape: tuple) -> Any:
        if len(shape) == 2 and shape[1] == 1:
            return padded((1, shape[0]))
        return None

    return positions
