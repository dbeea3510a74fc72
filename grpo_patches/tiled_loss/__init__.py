"""Tiled lm-head GRPO loss: exact, never materializes ``[tokens, vocab]`` logits.

:func:`tiled_grpo_loss` projects hidden states through the lm-head weight one tile of
tokens at a time, computes the GRPO objective and its gradients for that tile, and keeps
only one fp32 logits buffer alive: ``[tile, vocab]`` on the torch path (CPU, fp64, no Triton),
``[4096 tokens, vocabulary chunk]`` in the fused Triton fold on CUDA (:mod:`.fold`).
:func:`dense_grpo_loss` is the plain reference with the same signature. :func:`tiled_token_stats`
is the no-grad tiled pass that returns per-token log-probs and entropies (e.g. for TRL's
high-entropy token mask), through the same fold on CUDA.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo_patches.tiled_loss.dense import dense_grpo_loss
from grpo_patches.tiled_loss.function import LoopResult, TiledGRPOLossFunction
from grpo_patches.tiled_loss.inputs import flatten_inputs
from grpo_patches.tiled_loss.metrics import build_metrics
from grpo_patches.tiled_loss.options import AGGREGATIONS, OBJECTIVES, LossOptions, resolve_options
from grpo_patches.tiled_loss.token_stats import tiled_token_stats
from grpo_patches.tiled_loss.zero3 import gathered_weight

__all__ = [
    "AGGREGATIONS",
    "OBJECTIVES",
    "LossOptions",
    "dense_grpo_loss",
    "resolve_options",
    "tiled_grpo_loss",
    "tiled_token_stats",
]


def tiled_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    is_weights: torch.Tensor | None = None,
    sampling_logps: torch.Tensor | None = None,
    policy_token_mask: torch.Tensor | None = None,
    entropy_token_mask: torch.Tensor | None = None,
    **options: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO policy loss of ``softmax(logits / temperature)`` at ``labels``.

    ``logits = hidden @ weight.T + bias``, then the model's own transforms in the order the HF
    models apply them: ``* logit_scale``, then ``logit_softcap * tanh(logits / logit_softcap)``;
    the temperature division comes last (TRL divides the model's logits).

    :param hidden: ``[B, T, H]`` or ``[N, H]`` (fp32, bf16, fp16 or fp64) hidden states
        aligned with ``labels`` (already shifted: ``hidden[t]`` predicts ``labels[t]``).
    :param weight: ``[V, H]`` lm-head weight (tied embeddings and a ZeRO-3 partitioned
        weight are fine: it is gathered for the forward, its gradient returns through autograd).
    :param labels: token ids, ``hidden.shape[:-1]``.
    :param advantages: per token (``labels``' shape), per row (``[B]``) or a scalar.
    :param mask: loss mask (``labels``' shape, 0/1 or float weights); ``None`` = all tokens.
        Masked tokens are skipped entirely; per-token outputs are 0 there.
    :param old_logps: behaviour-policy log-probs; ``None`` = on-policy (ratio 1).
    :param ref_logps: reference log-probs for the KL term / ``kl_mean`` metric.
    :param bias: optional ``[V]`` lm-head bias.
    :param temperature: logits are divided by it before the softmax.
    :param is_weights: per-token importance-sampling weights (e.g. truncated IS of the
        rollout/trainer mismatch), multiplied into the policy term (not the KL term); VESPO
        folds them into its sequence ratio instead, as TRL does.
    :param sampling_logps: generator log-probs for the off-policy sequence mask
        (default ``old_logps``).
    :param policy_token_mask: per-token multiplier of the policy term (not the KL term), e.g.
        TRL's high-entropy mask (``top_entropy_quantile < 1``). Only a multiplier: every
        aggregation's denominators still come from ``mask`` (and ``normalizer``), and metrics
        stay means over ``mask``.
    :param entropy_token_mask: the same for the entropy-bonus term; its denominators come from
        ``mask`` too, so pass ``entropy_normalizer`` for TRL's ``sum(mask * entropy_mask)``.
    :param options: keyword options, see :class:`~grpo_patches.tiled_loss.options.LossOptions`:
        ``objective`` (clip/cispo/sapo/vespo; default clip), ``aggregation`` (token-mean
        (default), seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm,
        token-sum), ``normalizer`` (external denominator: token count for token-level, row
        count for row-level aggregations),
        ``max_completion_length`` (seq-mean-token-sum-norm / dr_grpo; default T),
        ``epsilon_low``/``epsilon_high`` (0.2), ``delta`` (dual clip), ``cispo_max_ratio``,
        ``sapo_temperature_pos/neg``, ``vespo_k_pos/lambda_pos/k_neg/lambda_neg``,
        ``importance_sampling_level`` (token/sequence), ``log_ratio_clamp``,
        ``off_policy_mask_threshold``, ``beta`` (KL coefficient, 0), ``kl_estimator``
        (k1/k2/k3, or a callable ``(logps, ref_logps) -> per-token KL``), ``kl_clamp``,
        ``kl_ratio_correction`` (TRL use_bias_correction_kl),
        ``entropy_coef``, ``entropy_aggregation``, ``entropy_normalizer``, ``logit_scale``
        (multiplier of the raw logits, 1.0: Cohere's ``logit_scale``, Granite's
        ``1 / logits_scaling``), ``logit_softcap`` (Gemma-2's ``final_logit_softcapping``;
        ``None``: off), ``tile_size`` (tokens per tile; default: from the budget, at most 512 on
        the torch path, 4096 in the CUDA fold), ``tile_memory_bytes`` (fp32 logits-buffer budget,
        512 MiB: the torch path's tile of tokens x the whole vocabulary, or the fold's vocabulary
        chunk), ``return_logps``,
        ``return_entropy``, ``return_token_metrics``, ``retain_grads`` (keep the stored
        gradients so that backward may run more than once, e.g. gradcheck; costs a copy).
    :return: ``(loss, metrics)``: a scalar fp32 loss (fp64 for fp64 inputs) and detached
        metrics (``token_count``, ``ratio_mean``, ``clip_frac_low/high``, ``clip_frac``,
        ``clip_frac_dual``, ``kl_mean``, ``entropy_mean``, ``vespo_phi_mean`` where they apply;
        ``logps``, ``entropy``, ``token_*`` per token when requested).
    """
    opts = resolve_options(temperature=temperature, **options)
    with gathered_weight(weight, bias):  # ZeRO-3: the full weight for this forward only
        return _tiled_loss(hidden, weight, labels, advantages, mask, opts, old_logps=old_logps,
                           ref_logps=ref_logps, bias=bias, is_weights=is_weights, sampling_logps=sampling_logps,
                           policy_token_mask=policy_token_mask, entropy_token_mask=entropy_token_mask)


def _tiled_loss(hidden, weight, labels, advantages, mask, opts: LossOptions, *, bias,
                **per_token: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    batch = flatten_inputs(
        hidden,
        weight,
        labels,
        advantages,
        mask,
        bias=bias,
        opts=opts,
        **per_token,
    )
    grad_on = torch.is_grad_enabled()
    needs = (
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        grad_on and bias is not None and bias.requires_grad,
    )
    result = LoopResult()
    loss = TiledGRPOLossFunction.apply(batch.hidden, weight, bias, batch, opts, result, needs)
    metrics = build_metrics(
        result.sums, batch.mask.sum(), result.token_values, opts, batch.token_shape, batch.ref_logps is not None
    )
    return loss, metrics
