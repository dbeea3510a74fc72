"""The tiled lm-head loss in the DTensor policy worker v2 (v0.6.0+).

NeMo-RL's DTensor worker materialises ``[batch, sequence, vocab]`` logits for the loss (only
its Megatron backend has a fused path). Here, for each training micro-batch, the model's real
forward runs (FSDP2's unshard hooks fire as usual) with ``lm_head.forward`` swapped, for that
forward only, for one that passes the last hidden state and the lm-head weight to the
``grpo_lm_head_loss`` hook (the tiled loss: one tile of logits at a time) with
``ClippedPGLossFn``'s objective — clipped ratio, dual clip, token- or sequence-level mean
over the global counts, the sampling temperature. The model then returns that loss broadcast
where the logits were (the autograd path through the model output, and its FSDP hooks, stay
intact); NeMo-RL's temperature scaling passes it through and ``LossPostProcessor`` returns it,
with the metrics of the real ``ClippedPGLossFn`` called without autograd on the tiled loss's
per-token log-probs (so every logged metric is NeMo-RL's own).

Wrapped (module attributes of ``nemo_rl.models.automodel.train``, looked up at call time):
``forward_with_post_processing_fn``, ``apply_temperature_scaling``, ``LossPostProcessor.__call__``.
What it does not reproduce (:mod:`.tiled_coverage`) keeps NeMo-RL's loss (``"auto"``) or raises (``True``).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from grpo_patches.call_args import bind
from grpo_patches.caller_frame import unwrap

from . import FRAMEWORK
from .calls import loss_mask
from .loss_modes import loss_mode
from .state import MICROBATCH, PREV_IS_CURRENT, TiledMicrobatch, current_train
from .tiled_coverage import not_reproduced, unsupported_loss_settings, unsupported_worker_settings


def decide(loss_fn: Any, worker: Any) -> bool:
    """Whether this train call's loss goes through the tiled loss.

    :raises IncompatibleOptionsError: ``tiled_loss=True`` with a setting it does not reproduce.
    """
    problems = unsupported_loss_settings(loss_fn) + unsupported_worker_settings(
        worker, worker, getattr(worker, "sampling_params", None))
    if problems:
        return FRAMEWORK.refuse_or_note("tiled_loss", not_reproduced(problems))
    FRAMEWORK.note("tiled_loss", "on (ClippedPGLossFn through grpo_lm_head_loss)")
    return True


def _loss_options(micro: TiledMicrobatch, head: Any) -> dict[str, Any]:
    loss_fn, data = micro.loss_fn, micro.data
    on_policy = getattr(loss_fn, "force_on_policy_ratio", False) or getattr(loss_fn, PREV_IS_CURRENT, False)
    token_level = loss_mode(loss_fn) == "TOKEN_LEVEL"
    count = micro.global_valid_toks if token_level else micro.global_valid_seqs
    options: dict[str, Any] = dict(
        old_logps=None if on_policy else data["prev_logprobs"][:, 1:],  # on-policy: ratio 1, as NeMo-RL's
        temperature=micro.temperature,
        objective="clip",  # ClippedPGLossFn's clipped ratio (dual clip: delta)
        aggregation="token-mean" if token_level else "seq-mean-token-mean",
        normalizer=float(count) + 1e-8,  # NeMo-RL's masked_mean divides by (count + 1e-8)
        epsilon_low=loss_fn.ratio_clip_min,
        epsilon_high=loss_fn.ratio_clip_max,
        delta=loss_fn.ratio_clip_c,
        return_logps=True,
        bias=head.bias,
    )
    tile_size = FRAMEWORK.setting("tile_size")
    if tile_size is not None:
        options["tile_size"] = tile_size
    return options


def _tiled_head(head: Any) -> Callable[[Any], Any]:
    def forward(hidden: Any) -> Any:
        from grpo_patches.plugins import hook

        micro = MICROBATCH.current()
        data = micro.data
        device = hidden.device
        mask = loss_mask(data).to(device)
        micro.loss, values = hook().grpo_lm_head_loss(
            hidden=hidden[:, :-1], weight=head.weight, labels=data["input_ids"][:, 1:].to(device),
            advantages=data["advantages"][:, 1:].to(device), mask=mask, options=_loss_options(micro, head))
        micro.logps = values["logps"]
        batch, length = hidden.shape[:2]
        return micro.loss.reshape(1, 1, 1).expand(batch, length, 1)  # stands where the logits were

    return forward


def forward_with_post_processing_fn(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``forward_with_post_processing_fn(model, post_processing_fn, processed_mb, ...)``: the micro-batch
    as a :class:`~.state.TiledMicrobatch`, the model's real forward with ``lm_head`` swapped."""
    import torch

    train = current_train()
    if train is None or not train.tiled_on or not torch.is_grad_enabled():
        return wrapped(*args, **kwargs)
    call = bind(wrapped, args, kwargs)
    post = call["post_processing_fn"]
    if not isinstance(post, sys.modules[unwrap(wrapped).__module__].LossPostProcessor):
        return wrapped(*args, **kwargs)
    sampling = call.get("sampling_params")
    micro = TiledMicrobatch(data=call["processed_mb"].data_dict, loss_fn=post.loss_fn,
                            global_valid_seqs=call["global_valid_seqs"], global_valid_toks=call["global_valid_toks"],
                            temperature=float(getattr(sampling, "temperature", 1.0) or 1.0))
    head = call["model"].lm_head
    with MICROBATCH.entered(micro):
        head.forward = _tiled_head(head)  # this forward only: an instance attribute over the class's method
        try:
            return wrapped(*args, **kwargs)
        finally:
            del head.forward


def apply_temperature_scaling(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``apply_temperature_scaling(logits, sampling_params)``: the tiled loss applied it already."""
    micro = MICROBATCH.current()
    if micro is not None and micro.loss is not None:
        return bind(wrapped, args, kwargs)["logits"]
    return wrapped(*args, **kwargs)


def call(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``LossPostProcessor.__call__(logits, data_dict, ...)``: the tiled loss, NeMo-RL's metrics."""
    micro = MICROBATCH.current()
    if micro is None or micro.loss is None:
        return wrapped(*args, **kwargs)
    import torch

    arguments = bind(wrapped, args, kwargs)
    with torch.no_grad():
        _, metrics = instance.loss_fn(next_token_logprobs=micro.logps.detach().float(), data=arguments["data_dict"],
                                      global_valid_seqs=arguments["global_valid_seqs"],
                                      global_valid_toks=arguments["global_valid_toks"])
    loss = arguments["logits"][0, 0, 0]  # the tiled loss, through the model's output
    micro.loss = None
    return loss, metrics
