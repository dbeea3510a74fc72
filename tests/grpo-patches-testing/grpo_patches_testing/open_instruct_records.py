"""What a run of open-instruct's learner on a CPU records (:class:`Result`), by hooks on the
engines' modules (test-only, nothing changed): the grad norm DeepSpeed reports after each optimizer
step, the final weights (gathered under ZeRO-3), forwards of the reference model, no-grad forwards
of the policy (open-instruct's old-logprob pre-pass), grad-enabled forwards of the policy (the
training forwards), the largest lm-head output and whether a full ``[B, T, vocab]`` logits tensor
was made, ``step()``'s metrics, the lm-head weight's shard, and (observing
``grpo_utils.resolve_old_logprob``, which is called through) how far the pre-pass's old log-probs
of epoch 0's first accumulation group lie from the training forward's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from grpo_patches_testing.open_instruct_cpu import Config


@dataclass
class Result:
    grad_norms: list[float] = field(default_factory=list)  # DeepSpeed's, one per optimizer step
    weights: dict[str, Any] = field(default_factory=dict)  # final, full (gathered under ZeRO-3)
    snapshots: list[dict[str, Any]] = field(default_factory=list)  # after each optimizer step
    metrics: list[dict[str, float]] = field(default_factory=list)  # step()'s, per step
    ref_forwards: int = 0
    old_logprob_forwards: int = 0  # no-grad policy forwards: the pre-pass's micro-batches
    policy_forwards: int = 0  # grad-enabled policy forwards
    policy_rows: int = 0  # packed rows through the grad-enabled forwards
    policy_tokens: int = 0  # rows x columns of those forwards
    step_seconds: list[tuple[float, float]] = field(default_factory=list)  # (wall, CPU) seconds of each step()
    micro_batches: list[int] = field(default_factory=list)  # handed to step() on this rank, per step
    micro_batch_shapes: list[list[tuple[int, ...]]] = field(default_factory=list)  # their query_responses, per step
    gradients: list[dict[str, Any]] = field(default_factory=list)  # before each optimizer step (where whole)
    largest_logits: tuple[int, ...] = ()  # the largest lm-head output seen
    full_logits: int = 0  # lm-head outputs of [B, T, vocab]
    ref_model_built: bool = False
    #: the largest |pre-pass old log-prob - training forward's log-prob| over the micro-batches of
    #: epoch 0's first accumulation group (consumed before any optimizer step); None: no pre-pass
    first_group_old_vs_new: float | None = None
    #: the lm-head weight: (its full number of elements, the elements this rank holds); ZeRO-3
    #: holds a 1/world shard outside the lm-head's forward, ZeRO-2 the whole weight
    lm_head_elements: tuple[int, int] = (0, 0)
    #: ``grpo_patches.status()["open_instruct"]`` at the end of a run with ``Config.enable`` (notes, savings)
    status: dict[str, Any] = field(default_factory=dict)


def full_weights(engine: Any, stage: int) -> dict[str, Any]:
    """Every parameter of the engine's module, full size: the fp32 master copy DeepSpeed's ZeRO
    optimizer holds (a collective under ZeRO-3: every rank calls it). Gathering the module's own
    ZeRO-3 parameters (``GatheredParameters``) after the last step once returned a NaN-filled
    embedding on one of two ranks on a loaded machine; the optimizer's copy is what the next step
    starts from."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param

    if dist.is_initialized():
        dist.barrier()
    out = {}
    for name, param in engine.module.named_parameters():
        full = safe_get_full_fp32_param(param)
        if full is None:  # not trained (no optimizer copy): the module's own tensor
            import deepspeed

            gather = deepspeed.zero.GatheredParameters([param]) if stage == 3 else contextlib.nullcontext()
            with gather:
                full = param.detach()
        shape = getattr(param, "ds_shape", param.shape)
        out[name] = full.detach().clone().to(torch.float32).reshape(shape)
    return out


def count_forwards(policy: Any, ref: Any, lm_heads: list[Any], vocab: int, result: Result) -> list[Any]:
    """Hooks (removable handles) counting the policy's grad-enabled forwards (training) and no-grad
    forwards (the old-logprob pre-pass), the reference's forwards, and sizing every lm-head output
    (``policy`` or ``ref`` ``None``: not counted)."""
    import torch

    def count_policy(_module: Any, args: Any, kwargs: Any) -> None:
        if torch.is_grad_enabled():
            ids = kwargs.get("input_ids", args[0] if args else None)
            result.policy_forwards += 1
            result.policy_rows += int(ids.shape[0])
            result.policy_tokens += int(ids.numel())
        else:
            result.old_logprob_forwards += 1

    def count_ref(_module: Any, _args: Any, _kwargs: Any) -> None:
        result.ref_forwards += 1

    def logits(_module: Any, _args: Any, output: Any) -> None:
        out = getattr(output, "logits", output)
        shape = tuple(out.shape)
        if not result.largest_logits or out.numel() > _numel(result.largest_logits):
            result.largest_logits = shape
        result.full_logits += int(len(shape) == 3 and shape[-1] == vocab)

    handles = [] if policy is None else [policy.register_forward_pre_hook(count_policy, with_kwargs=True)]
    if ref is not None:
        handles.append(ref.register_forward_pre_hook(count_ref, with_kwargs=True))
    return handles + [head.register_forward_hook(logits) for head in lm_heads]


@contextlib.contextmanager
def recording(learner: Any, config: Config, result: Result) -> Iterator[None]:
    policy = learner.model.module
    result.ref_model_built = getattr(learner, "ref_policy", None) is not None
    ref = learner.ref_policy.module if result.ref_model_built else None
    heads = [policy.get_output_embeddings()] + ([ref.get_output_embeddings()] if ref is not None else [])
    handles = count_forwards(policy, ref, heads, policy.config.vocab_size, result)
    if config.lm_head_float64:
        assert not (config.enable or {}).get("tiled_loss"), "lm_head_float64 rounds open-instruct's own lm-head"
        handles.append(heads[0].register_forward_hook(_float64_matmul))
    engine = learner.model
    real_norm, real_step = engine.get_global_grad_norm, engine.step

    def get_global_grad_norm(*a: Any, **k: Any) -> Any:
        norm = real_norm(*a, **k)
        result.grad_norms.append(float(norm))
        return norm

    def step(*a: Any, **k: Any) -> Any:
        out = real_step(*a, **k)
        if config.snapshots:
            result.snapshots.append(full_weights(engine, config.deepspeed_stage))
        return out

    engine.get_global_grad_norm, engine.step = get_global_grad_norm, step
    weight = policy.get_output_embeddings().weight
    result.lm_head_elements = (int(getattr(weight, "ds_numel", weight.numel())),
                               int(weight.ds_tensor.numel() if hasattr(weight, "ds_tensor") else weight.numel()))
    from open_instruct import grpo_utils

    real_resolve = grpo_utils.resolve_old_logprob

    def resolve_old_logprob(cache: list, i: int, epoch: int, num_mini_batches: int, *args: Any) -> Any:
        old = real_resolve(cache, i, epoch, num_mini_batches, *args)  # observed, never changed
        first_group = len(cache) // num_mini_batches  # accumulation_steps (len(cache) is a multiple)
        if num_mini_batches > 1 and epoch == 0 and i < first_group:
            gap = float((old - args[-1].detach()).abs().max())
            result.first_group_old_vs_new = max(result.first_group_old_vs_new or 0.0, gap)
        return old

    grpo_utils.resolve_old_logprob = resolve_old_logprob
    try:
        yield
    finally:
        grpo_utils.resolve_old_logprob = real_resolve
        del engine.get_global_grad_norm, engine.step
        for handle in handles:
            handle.remove()


def _float64_matmul(layer: Any, args: Any, _output: Any) -> Any:
    """The layer's output recomputed in float64 and rounded to its dtype (gradients flow through)."""
    import torch.nn.functional as F

    hidden = args[0]
    bias = None if layer.bias is None else layer.bias.double()
    return F.linear(hidden.double(), layer.weight.double(), bias).to(hidden.dtype)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

