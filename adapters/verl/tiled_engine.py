"""Tiled lm-head loss on verl's FSDP engine (0.8.0-0.9.1; :mod:`.tiled`).

``FSDPEngineWithLMHead.forward_step(micro_batch, loss_function, forward_only)`` (wrapped)
runs the model forward and then ``ppo_loss`` for one micro-batch, so the micro-batch's
:class:`~.state.TiledCall` is ``MicroBatchCall.tiled`` for both. The engine keeps ``input_ids`` nested
(``left_right_2_no_padding``) and slices each response out of the model's per-token output
with ``no_padding_2_padding``; the call maps response tokens to hidden-state positions by
calling that very function on the token indices (packed ``[1, nnz]`` layout, or the padded
``[B, max_len]`` one without ``use_remove_padding``). Token weights: verl's ``agg_loss``
with the global counts ``ppo_loss`` passes it (``dp_size``, ``batch_num_tokens`` as the
zero-advantage filter keeps it, ``global_batch_size``, ``loss_scale_factor``).
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import bind

from . import metrics as verl_metrics
from . import state, tiled
from .calls_engine import actor_config_of
from .multimodal import has_multimodal_inputs
from .zero_advantage_engine import batch_num_tokens_of

#: ppo_loss's inputs, in the padded response layout it builds (``select(...).to_padded_tensor()``).
_FIELDS = ("response_mask", "old_log_probs", "advantages", "rollout_is_weights", "ref_log_prob", "responses")

def problems(engine: Any, config: Any, micro: Any) -> list[str]:
    from verl.utils import tensordict_utils as tu

    fused = bool(tu.get_non_tensor_data(data=micro, key="use_fused_kernels", default=False))
    return tiled.config_problems(config, fused=fused, backend=tiled.fused_backend(engine.module),
                                 sp=int(getattr(engine, "ulysses_sequence_parallel_size", 1) or 1))


def _padded_inputs(micro: Any) -> dict:
    present = [name for name in _FIELDS if name in micro.keys()]
    return dict(micro.select(*present).to_padded_tensor().items())


def packed_positions(micro: Any) -> Callable[[tuple], Any]:
    import torch
    from verl.workers.utils.padding import no_padding_2_padding

    input_ids = micro["input_ids"]
    lengths = input_ids.offsets().diff().cpu()
    tokens = int(lengths.sum())
    response = no_padding_2_padding(torch.arange(tokens), micro)  # [B, R]: each response token's packed index

    def positions(shape: tuple) -> Any:
        if len(shape) == 2 and shape[0] == 1 and shape[1] >= tokens:  # packed (use_remove_padding)
            return response
        rows, width = len(lengths), int(lengths.max())
        if shape == (rows, width):  # padded [B, max_len], each row left-aligned
            grid = torch.arange(rows * width).view(rows, width)
            return grid[torch.arange(width)[None, :] < lengths[:, None]][response]
        return None

    return positions


def forward_step(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``FSDPEngineWithLMHead.forward_step(micro_batch, loss_function, forward_only)``."""
    call = bind(wrapped, args, kwargs)
    micro, config = call["micro_batch"], actor_config_of(call["loss_function"])
    if instance is None or call["forward_only"] or config is None or not tiled.enabled():
        return wrapped(*args, **kwargs)
    if not tiled.decide(instance, problems(instance, config, micro)):
        return wrapped(*args, **kwargs)
    tiled_call = training_call(instance, config, micro)
    if tiled_call is None:
        return wrapped(*args, **kwargs)
    with state.in_micro_batch(tiled=tiled_call):
        out = wrapped(*args, **kwargs)
    count(tiled_call)
    return out


def training_call(instance: Any, config: Any, micro: Any,
                  positions: Callable[[tuple], Any] | None = None) -> state.TiledCall | None:
    """The :class:`~.state.TiledCall` of one training micro-batch of the engine line (FSDP or Megatron:
    the same ``ppo_loss`` on the same nested micro-batch); ``None``: verl's own loss (declined, noted).
    ``positions``: the engine's hidden-state layout, if not FSDP's (:func:`packed_positions`)."""
    from verl.utils import tensordict_utils as tu

    if has_multimodal_inputs(micro.get("multi_modal_inputs", None) if "multi_modal_inputs" in micro.keys() else None):
        tiled.decline(instance, "multimodal inputs (not tested with the tiled loss)")
        return None
    full, rows = state.micro_batch().subset or (micro, None)  # dropped_rows_metrics: some rows of ``full``
    padded_full = _padded_inputs(full)
    info = {"dp_size": full["dp_size"], "batch_num_tokens": batch_num_tokens_of(full),
            "global_batch_size": full["global_batch_size"], "loss_scale_factor": config.loss_scale_factor}
    mask_full = padded_full["response_mask"].to(bool)
    padded = _padded_inputs(micro)
    on_policy = state.update().on_policy is not None  # the skipped pass: verl's loss gets the current log-probs

    def inputs() -> dict:
        return {"response_mask": padded["response_mask"], "advantages": padded["advantages"],
                "old_log_probs": None if on_policy else padded["old_log_probs"],
                "rollout_is_weights": padded.get("rollout_is_weights"), "ref_log_prob": padded.get("ref_log_prob")}

    return state.TiledCall(
        owner=instance, config=config, inputs=inputs, positions=positions or packed_positions(micro),
        weights=tiled.token_weights(mask_full, config.loss_agg_mode, info), loss_agg_mode=config.loss_agg_mode,
        info=info, calculate_entropy=bool(tu.get_non_tensor_data(data=micro, key="calculate_entropy", default=False)),
        responses=padded.get("responses"), rows=rows)


def count(call: state.TiledCall) -> None:
    """Count the micro-batch in status() and verl's metrics if its loss was the tiled one."""
    if call.loss is not None:
        verl_metrics.report(None, tiled_loss_micro_batches=1)
