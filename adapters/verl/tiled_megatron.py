"""The tiled lm-head loss on verl's Megatron engine (0.8.0+; :mod:`.tiled`), and the fused kernel's answer
shared with the legacy ``MegatronPPOActor`` (0.6.1-0.7.x, :mod:`.tiled_megatron_legacy`).

With ``model.use_fused_kernels=True`` verl's Megatron engine runs ``fused_forward_model_engine``:
the micro-batch packed (THD, ``preprocess_thd_engine``), and at the last pipeline stage one call
``linear_cross_entropy(hidden [tokens, 1, H], output weight, rolled labels, temperature, "none",
tp_group)`` (``verl.models.mcore.model_forward_fused``: Megatron's output-processor hook, or verl's
patched ``GPTModel.forward`` before megatron-core 0.18) in place of the output layer's projection.
With tensor parallel 1 that weight is the whole vocabulary, as with FSDP, so the tiled loss answers
that call:

1. :func:`forward_step` (wrapping ``MegatronEngineWithLMHead.forward_step``, which Megatron's
   schedule calls per micro-batch) takes the micro-batch from the iterator, describes it in a
   :class:`~.state.TiledCall` (:func:`.tiled_engine.training_call`: the same ``ppo_loss`` on the
   same nested micro-batch as the FSDP engine) and keeps it as ``MicroBatchCall.tiled`` for the
   forward and for the loss function the schedule calls afterwards (the returned
   ``postprocess_micro_batch_func``);
2. :func:`linear_cross_entropy` computes the loss tile by tile from the response tokens' hidden
   states (packed position = nested index: no per-sequence padding with TP = CP = 1) and returns
   detached log-probs / entropies in the kernel's ``[tokens]`` layout;
3. :mod:`.tiled_policy_loss` hands verl's loss the tiled gradient with verl's value.

Tensor parallelism (the vocabulary split over ranks), context parallelism, pipeline parallelism
(untested), fp8 (padded packing), a vision model, or no fused kernels: ``"auto"`` keeps verl's own
loss with the reason in ``status()``; ``tiled_loss=True`` raises before the first update.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from grpo_patches.call_args import bind

from . import state, tiled, tiled_engine
from .calls_engine import actor_config_of


def problems(engine: Any, config: Any) -> list[str]:
    """The settings of ``engine`` (a ``MegatronEngine``) and ``config`` (the actor's) the tiled loss
    cannot reproduce yet, each with its fix."""
    found = tiled.config_problems(config, fused=True, backend=None, sp=1)  # the loss itself
    settings = engine.engine_config
    tp = int(getattr(settings, "tensor_model_parallel_size", 1) or 1)
    if tp > 1:
        found.append(f"tensor_model_parallel_size={tp} (tensor parallelism splits the vocabulary over ranks; the "
                     "tiled loss does not compute vocabulary-parallel log-probs yet: use 1)")
    if not getattr(settings, "use_fused_kernels", False):
        found.append("actor_rollout_ref.model.use_fused_kernels=False (the tiled loss answers verl's fused Megatron "
                     "forward: set use_fused_kernels=True with use_remove_padding=True; verl turns fused kernels off "
                     "without remove-padding and with MTP)")
    for name, why in (("context_parallel_size", "each rank holds part of every sequence"),
                      ("pipeline_model_parallel_size", "the last pipeline stage is not tested with the tiled loss")):
        size = int(getattr(settings, name, 1) or 1)
        if size > 1:
            found.append(f"{name}={size} ({why}; use 1)")
    if getattr(settings, "dynamic_context_parallel", False):
        found.append("dynamic_context_parallel=True (sequences split over ranks; use False)")
    if getattr(settings, "virtual_pipeline_model_parallel_size", None) not in (None, 1):
        found.append("virtual_pipeline_model_parallel_size (not tested with the tiled loss; use None)")
    if getattr(getattr(engine, "tf_config", None), "fp8", None):
        found.append("fp8 (verl pads each packed sequence; the tiled loss is not tested there)")
    if hasattr(getattr(getattr(engine, "model_config", None), "hf_config", None), "vision_config"):
        found.append("a vision-language model (not tested with the tiled loss)")
    return found


def forward_backward_batch(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``MegatronEngine.forward_backward_batch``: decides (once per engine) before the
    schedule runs, so that ``tiled_loss=True`` refuses before any micro-batch."""
    call = bind(wrapped, args, kwargs)
    config = actor_config_of(call["loss_function"])
    if instance is not None and not call["forward_only"] and config is not None and tiled.enabled():
        tiled.decide(instance, problems(instance, config))  # refuse-or-note
    return wrapped(*args, **kwargs)


def forward_step(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``MegatronEngineWithLMHead.forward_step(batch_iter, model, logits_processor_func,
    postprocess_micro_batch_func)``: one training micro-batch through the tiled loss."""
    call = bind(wrapped, args, kwargs)
    config = actor_config_of(call["logits_processor_func"])  # verl's forward_backward_batch passes its loss here
    postprocess = call["postprocess_micro_batch_func"]
    forward_only = (getattr(postprocess, "keywords", None) or {}).get("forward_only", True)
    if instance is None or forward_only or config is None or not tiled.enabled():
        return wrapped(*args, **kwargs)
    if not tiled.decide(instance, problems(instance, config)):
        return wrapped(*args, **kwargs)
    micro = next(call["batch_iter"])
    tiled_call = tiled_engine.training_call(instance, config, micro, positions=_positions(micro))
    if tiled_call is None:
        return call.call(wrapped, batch_iter=iter([micro]))
    with state.in_micro_batch(tiled=tiled_call):
        output, post = call.call(wrapped, batch_iter=iter([micro]))
    return output, functools.partial(_loss_with_call, tiled_call, post)


def _loss_with_call(tiled_call: state.TiledCall, post: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The schedule's loss call (``postprocess_micro_batch_func``, last stage) with the micro-batch's call running."""
    with state.in_micro_batch(tiled=tiled_call):
        out = post(*args, **kwargs)
    tiled_engine.count(tiled_call)
    return out


def _positions(micro: Any) -> Callable[[tuple], Any]:
    """Each response token's index in Megatron's ``[tokens, 1]`` packed hidden states: the packed
    (``[1, tokens]``) layout of the FSDP engine, transposed (TP = CP = 1: no per-sequence padding)."""
    packed = tiled_engine.packed_positions(micro)

    def positions(shape: tuple) -> Any:
        if len(shape) == 2 and shape[1] == 1:
            return packed((1, shape[0]))
        return None

    return positions


def linear_cross_entropy(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``linear_cross_entropy(hidden, weight, labels, temperature, reduction, tp_group)`` as
    bound in ``verl.models.mcore.model_forward_fused``: the running training micro-batch's tiled loss."""
    import torch

    call = state.micro_batch().tiled
    if call is None or call.loss is not None or call.declined or not torch.is_grad_enabled():
        return wrapped(*args, **kwargs)
    given = _kernel_arguments(wrapped, args, kwargs)
    hidden, weight, labels = given["hidden"], given["weight"], given["labels"]
    temperature, reduction, group = given["temperature"], given["reduction"], given["dist_process_group"]
    if reduction != "none" or (group is not None and torch.distributed.get_world_size(group) > 1):
        call.declined = "the fused kernel was called with a vocabulary split over ranks or a reduction"
        return wrapped(*args, **kwargs)
    out = tiled.compute(call, hidden, weight, labels, float(temperature))
    if out is None:
        return wrapped(*args, **kwargs)
    log_probs, entropy = out
    return log_probs.reshape(-1), entropy.reshape(-1)  # the kernel's layout: one value per packed token


def _kernel_arguments(wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """The kernel call's arguments by name: ``linear_cross_entropy`` is ``LinearCrossEntropy.apply`` (an
    autograd function, ``apply(*args)``), whose ``forward(ctx, hidden, weight, labels, temperature,
    reduction, dist_process_group)`` names them."""
    forward = getattr(getattr(wrapped, "__self__", None), "forward", None)
    return bind(wrapped, args, kwargs) if forward is None else bind(forward, (None, *args), kwargs)
