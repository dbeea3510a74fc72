"""Per-token GRPO math, shared by the tiled and the dense paths.

Everything here works on flat ``[n]`` token vectors. Sequence-level quantities (GSPO ratios,
VESPO weights, the off-policy sequence mask) reduce over ``row`` (a local row index per
token), so the caller must pass whole rows for them. The formulas follow TRL 1.16
``GRPOTrainer._compute_loss`` operation by operation so that autograd gives the same
gradients (including its tie-breaking in ``min``/``clamp``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grpo_patches.tiled_loss.options import LossOptions


@dataclass
class TokenInputs:
    """Per-token inputs of one group of tokens (a tile, or the whole batch in the dense path)."""

    advantages: torch.Tensor
    mask: torch.Tensor
    old_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    sampling_logps: torch.Tensor | None = None
    policy_token_mask: torch.Tensor | None = None  # multiplier of the policy term (e.g. TRL's entropy mask)
    row: torch.Tensor | None = None  # local row index of each token, 0..n_rows-1
    n_rows: int = 0


@dataclass
class TokenStats:
    """Detached per-token quantities for metrics (``None`` when not defined for the objective)."""

    ratio: torch.Tensor
    low_clipped: torch.Tensor | None = None
    high_clipped: torch.Tensor | None = None
    dual_clipped: torch.Tensor | None = None
    kl: torch.Tensor | None = None
    phi: torch.Tensor | None = None


def row_sum(x: torch.Tensor, inputs: TokenInputs) -> torch.Tensor:
    """Sum of ``x`` over each row, broadcast back to the row's tokens (differentiable)."""
    if inputs.row is None:
        raise ValueError("a sequence-level quantity needs row indices ([B, T] inputs)")
    sums = x.new_zeros(inputs.n_rows).index_add(0, inputs.row, x)
    return sums[inputs.row]


def kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str) -> torch.Tensor:
    """KL(pi || ref) per token: k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) + log r - 1."""
    if estimator == "k1":
        return logps - ref_logps
    if estimator == "k2":
        return 0.5 * (logps - ref_logps) ** 2
    diff = ref_logps - logps  # TRL's k3 written exactly as TRL writes it
    return torch.exp(diff) - diff - 1


@torch.no_grad()
def vespo_weights(
    advantages: torch.Tensor, log_ratio: torch.Tensor, inputs: TokenInputs, opts: LossOptions
) -> torch.Tensor:
    """VESPO's detached gamma weight phi(w) of the sequence ratio w (TRL ``get_gamma_weights``)."""
    lower = math.log(1e-8)
    seq_log_ratio = row_sum(torch.clamp(log_ratio, -20.0, 20.0) * inputs.mask, inputs)
    if inputs.is_weights is not None:
        log_is = torch.clamp(torch.log(inputs.is_weights), lower, 20.0)
        seq_log_ratio = seq_log_ratio + row_sum(log_is * (inputs.mask != 0), inputs)
    log_w = torch.clamp(seq_log_ratio, lower, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, opts.vespo_k_pos, opts.vespo_k_neg)
    lam = torch.where(nonneg, opts.vespo_lambda_pos, opts.vespo_lambda_neg).clamp(min=1e-4)
    log_phi = lam + k * log_w - lam * torch.exp(log_w)
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def token_objective(
    logps: torch.Tensor, inputs: TokenInputs, opts: LossOptions
) -> tuple[torch.Tensor, TokenStats]:
    """Per-token loss (before aggregation) as a differentiable function of ``logps``."""
    adv = inputs.advantages
    old = logps.detach() if inputs.old_logps is None else inputs.old_logps
    log_ratio = logps - old
    if opts.log_ratio_clamp is not None:  # verl clamps the log-ratio to +-20 before exp
        log_ratio = torch.clamp(log_ratio, -opts.log_ratio_clamp, opts.log_ratio_clamp)
    if opts.importance_sampling_level == "sequence":
        mask = inputs.mask
        count = row_sum(mask, inputs).clamp(min=1.0)
        log_weights = row_sum(log_ratio * mask, inputs) / count
    else:
        log_weights = log_ratio
    coef_1 = torch.exp(log_weights)

    kl = None
    if inputs.ref_logps is not None:
        kl = kl_estimate(logps, inputs.ref_logps, opts.kl_estimator)
        if opts.kl_clamp is not None:
            kl = torch.clamp(kl, -opts.kl_clamp, opts.kl_clamp)
        if opts.kl_ratio_correction:  # TRL use_bias_correction_kl (the ratio is not detached)
            kl = kl * coef_1

    stats = TokenStats(ratio=coef_1.detach())
    if opts.objective == "clip":
        coef_2 = torch.clamp(coef_1, 1 - opts.epsilon_low, 1 + opts.epsilon_high)
        if opts.delta is not None:  # TRL's two-sided clip == verl's dual clip (clip_ratio_c)
            coef_1 = torch.clamp(coef_1, max=opts.delta)
        loss = -torch.min(coef_1 * adv, coef_2 * adv)
        ratio = coef_1.detach()
        stats.low_clipped = (ratio < 1 - opts.epsilon_low) & (adv < 0)
        stats.high_clipped = (ratio > 1 + opts.epsilon_high) & (adv > 0)
        if opts.delta is not None:
            stats.dual_clipped = (stats.ratio > opts.delta) & (adv < 0)
    elif opts.objective == "cispo":
        clamped = torch.clamp(coef_1, max=opts.cispo_max_ratio).detach()
        loss = -clamped * adv * logps
        stats.high_clipped = (coef_1.detach() > opts.cispo_max_ratio) & (adv > 0)
        stats.low_clipped = torch.zeros_like(stats.high_clipped)  # CISPO has no lower bound
    elif opts.objective == "sapo":
        temps = torch.where(adv > 0, opts.sapo_temperature_pos, opts.sapo_temperature_neg)
        loss = -(torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps) * adv
    else:  # vespo
        phi = vespo_weights(adv, log_ratio.detach(), inputs, opts)
        loss = -phi * adv * logps
        stats.phi = phi
    if opts.delta is not None and stats.dual_clipped is None:  # delta only shapes the clip objective (as in TRL)
        stats.dual_clipped = torch.zeros_like(stats.ratio, dtype=torch.bool)

    if opts.off_policy_mask_threshold is not None:  # DeepSeek-V3.2 off-policy sequence mask
        sampling = inputs.sampling_logps if inputs.sampling_logps is not None else old
        kl_div = torch.nan_to_num(sampling - logps.detach(), nan=0.0)
        avg = row_sum(kl_div * inputs.mask, inputs) / row_sum(inputs.mask, inputs).clamp(min=1.0)
        keep = (adv >= 0) | (avg <= opts.off_policy_mask_threshold)
        loss = loss * keep.to(loss.dtype)
    if inputs.policy_token_mask is not None:  # where TRL applies its entropy mask: after the sequence mask
        loss = loss * inputs.policy_token_mask
    if inputs.is_weights is not None and opts.objective != "vespo":
        loss = loss * inputs.is_weights
    if opts.beta != 0.0:
        if kl is None:
            raise ValueError("beta != 0 needs ref_logps")
        loss = loss + opts.beta * kl
    if kl is not None:
        stats.kl = kl.detach()
    return loss, stats
