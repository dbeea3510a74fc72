"""Plain dense reference of the GRPO lm-head loss (materializes ``[tokens, vocab]`` logits).

Same signature and outputs as :func:`~grpo_patches.tiled_loss.tiled_grpo_loss`; gradients
come from autograd. Used by the tests and the benchmark as the ground truth; it shares only
the per-token objective with the tiled path (the aggregation is written the frameworks' way).
"""

from __future__ import annotations

from typing import Any

import torch

from grpo_patches.tiled_loss.aggregation import aggregate_dense
from grpo_patches.tiled_loss.inputs import flatten_inputs
from grpo_patches.tiled_loss.metrics import build_metrics
from grpo_patches.tiled_loss.objective import TokenInputs, token_objective
from grpo_patches.tiled_loss.options import resolve_options


def dense_grpo_loss(
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
    """Dense reference of :func:`~grpo_patches.tiled_loss.tiled_grpo_loss` (same arguments)."""
    opts = resolve_options(temperature=temperature, **options)
    batch = flatten_inputs(
        hidden,
        weight,
        labels,
        advantages,
        mask,
        old_logps=old_logps,
        ref_logps=ref_logps,
        is_weights=is_weights,
        sampling_logps=sampling_logps,
        policy_token_mask=policy_token_mask,
        entropy_token_mask=entropy_token_mask,
        bias=bias,
        opts=opts,
    )
    acc = batch.mask.dtype
    h2d = hidden.reshape(-1, hidden.shape[-1])
    logits = torch.nn.functional.linear(h2d, weight, bias).to(acc)
    # the model's own logit transforms (Cohere/Granite scale, then Gemma-2's softcap), then TRL's temperature
    if opts.logit_scale != 1.0:
        logits = logits * opts.logit_scale
    if opts.logit_softcap is not None:
        logits = torch.tanh(logits / opts.logit_softcap) * opts.logit_softcap
    logits = logits / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    logps = log_probs.gather(1, batch.labels[:, None]).squeeze(1)
    entropy = None
    if opts.needs_entropy:
        entropy = -(log_probs.exp() * log_probs).sum(-1)

    inputs = TokenInputs(
        advantages=batch.advantages,
        mask=batch.mask,
        old_logps=batch.old_logps,
        ref_logps=batch.ref_logps,
        is_weights=batch.is_weights,
        sampling_logps=batch.sampling_logps,
        policy_token_mask=batch.policy_token_mask,
        row=batch.row,
        n_rows=batch.n_rows,
    )
    per_token, stats = token_objective(logps, inputs, opts)
    shape = batch.token_shape
    mask = batch.mask.reshape(shape)
    loss = aggregate_dense(per_token.reshape(shape), mask, opts.aggregation, opts.normalizer, opts)
    if opts.entropy_coef != 0.0:
        if opts.entropy_aggregation is None:
            agg, norm = opts.aggregation, opts.normalizer
        else:
            agg, norm = opts.entropy_aggregation, opts.entropy_normalizer
        bonus = entropy if entropy_token_mask is None else entropy * entropy_token_mask.reshape(-1).to(acc)
        loss = loss - opts.entropy_coef * aggregate_dense(bonus.reshape(shape), mask, agg, norm, opts)

    m = batch.mask
    values = {
        "ratio": stats.ratio,
        "low_clipped": stats.low_clipped,
        "high_clipped": stats.high_clipped,
        "dual_clipped": stats.dual_clipped,
        "kl": stats.kl,
        "entropy": None if entropy is None else entropy.detach(),
        "phi": stats.phi,
    }
    sums = {k: (v.to(acc) * m).sum() for k, v in values.items() if v is not None}
    token_values = {k: (v.to(acc) * (m != 0)) for k, v in values.items() if v is not None}
    token_values["logps"] = logps.detach() * (m != 0)
    metrics = build_metrics(sums, m.sum(), token_values, opts, shape, batch.ref_logps is not None)
    return loss.to(torch.float64 if acc == torch.float64 else torch.float32), metrics
