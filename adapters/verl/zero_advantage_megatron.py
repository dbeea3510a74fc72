"""Zero-advantage filter for verl's Megatron engine (0.8.0+): ``MegatronEngine.forward_backward_batch``.

verl's Megatron engine computes the loss denominators exactly as its FSDP engine does (the
unfiltered ``batch_num_tokens`` all-reduced over DP, the trainer's ``global_batch_size``), then
makes micro-batches with ``same_micro_num_in_dp=True`` and runs Megatron's pipeline schedule.
``postprocess_micro_batch_func`` multiplies each micro-batch's loss by the micro-batch count
and Megatron's schedule divides it by the same count, so the filtered update (fewer
micro-batches) still sums the kept rows' global-denominator losses: :mod:`.zero_advantage_engine`
does the filtering, unchanged. What Megatron adds:

* **pipeline and tensor parallelism**: every rank of a model-parallel group holds the same
  rows (verl dispatches one DP shard to the whole group), so the hook's decision, the kept
  rows and the micro-batch count are the same on every stage and TP rank; the DP ranks agree
  through the hook (the same kept-row count everywhere) and verl's own micro-batch sync;
* **per-token loss** (``calculate_per_token_loss``, on with context parallelism): Megatron
  divides every gradient by the token count the micro-batches report, accumulated and
  all-reduced over DP. The filter keeps that count unfiltered: ``routed_num_tokens`` (verl's
  global count) keeps its unfiltered value, and the first micro-batch of each rank also
  reports the tokens of that rank's dropped rows (:func:`postprocess_micro_batch_func`);
* **not covered yet** (``"auto"`` switches the filter off with the reason in ``status()``,
  ``True`` raises): context parallelism, dynamic context parallelism, virtual pipeline stages,
  expert parallelism / MoE routers (their aux loss gives every token a gradient),
  multi-token prediction, and ``dropped_rows_metrics=True`` (no no-grad forward path here).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

from grpo_patches.call_args import bind

from . import FRAMEWORK, state, zero_advantage_engine
from .calls_engine import policy_update_call
from .megatron_stages import on_every_stage
from .zero_advantage import filter_mode


def megatron_problems(engine: Any) -> tuple[str, ...]:
    """Engine settings the filter does not cover on Megatron yet (each one named)."""
    engine_config, tf_config = engine.engine_config, getattr(engine, "tf_config", None)
    problems = []
    if FRAMEWORK.setting("dropped_rows_metrics", False):
        problems.append("dropped_rows_metrics=True is not available on verl's Megatron engine yet (no no-grad "
                        "forward for the dropped rows); pass dropped_rows_metrics=False")
    for name, what in (("context_parallel_size", "context parallelism"),
                       ("expert_model_parallel_size", "expert parallelism"),
                       ("virtual_pipeline_model_parallel_size", "virtual pipeline stages")):
        if int(getattr(engine_config, name, 1) or 1) > 1:
            problems.append(f"megatron.{name}={getattr(engine_config, name)} ({what}) is not covered yet")
    if getattr(engine_config, "dynamic_context_parallel", False):
        problems.append("megatron.dynamic_context_parallel=True is not covered yet")
    if tf_config is not None and (getattr(tf_config, "num_moe_experts", None) or 0) > 0:
        problems.append("a mixture-of-experts model: its router aux loss gives zero-advantage rows a gradient")
    model_config = getattr(engine, "model_config", None)
    mtp = getattr(model_config, "mtp", None)
    if mtp is not None and getattr(mtp, "enable", False):
        problems.append("multi-token prediction (model.mtp.enable=True) is not covered yet")
    return tuple(problems)


def forward_backward_batch(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``MegatronEngine.forward_backward_batch(data, loss_function, forward_only)``."""
    call = policy_update_call(wrapped, instance, args, kwargs)
    if call is None:
        return wrapped(*args, **kwargs)
    data, _, config = call
    problems = (*zero_advantage_engine.settings_problems(config, data), *megatron_problems(instance))
    if filter_mode(instance, config, extra_problems=problems) is None:  # decided once; the engine's filter reads it
        return wrapped(*args, **kwargs)
    per_token = bool(getattr(getattr(instance, "tf_config", None), "calculate_per_token_loss", False))
    if not per_token or not hasattr(instance, "_routed_num_tokens"):  # 0.8.0 has no per-token loss path
        return on_every_stage(zero_advantage_engine.forward_backward_batch, wrapped, instance, args, kwargs)

    routed = _global_routed_tokens(instance, data)
    unfiltered_local = int(instance._routed_num_tokens(data))

    @functools.wraps(wrapped)
    def with_unfiltered_routed_tokens(*a: Any, **kw: Any) -> Any:  # verl's call, as the engine's filter makes it
        dropped = unfiltered_local - int(instance._routed_num_tokens(bind(wrapped, a, kw)["data"]))
        packed = dataclasses.replace(state.update().packed or state.PackedBatch(), routed_num_tokens=routed,
                                     dropped_routed_tokens=dropped)
        with state.in_update(packed=packed):
            return wrapped(*a, **kw)

    return on_every_stage(zero_advantage_engine.forward_backward_batch, with_unfiltered_routed_tokens, instance, args,
                          kwargs)


def _global_routed_tokens(engine: Any, data: Any) -> int:
    """verl's ``routed_num_tokens`` of the unfiltered mini-batch (all-reduced over DP, as verl does)."""
    import torch

    count = engine._routed_num_tokens(data).clone().reshape(())
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.SUM, group=engine.get_data_parallel_group())
    return int(count.item())


def postprocess_micro_batch_func(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``MegatronEngineWithLMHead.postprocess_micro_batch_func(output, data, ...)``: under a
    per-token loss, the unfiltered global ``routed_num_tokens`` and, once per rank, the dropped rows' tokens."""
    packed = state.update().packed
    if packed is None or packed.routed_num_tokens is None:
        return wrapped(*args, **kwargs)
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(bind(wrapped, args, kwargs)["data"], routed_num_tokens=packed.routed_num_tokens)
    result = wrapped(*args, **kwargs)
    if isinstance(result, tuple) and len(result) == 3 and packed.dropped_routed_tokens:
        loss_sum, num_tokens, output = result
        num_tokens = num_tokens + packed.dropped_routed_tokens  # Megatron sums these over micro-batches and DP ranks
        packed.dropped_routed_tokens = 0
        result = (loss_sum, num_tokens, output)
    return result
