"""Metric dictionary shared by the tiled and dense paths (computed from mask-weighted sums)."""

from __future__ import annotations

import torch

from grpo_patches.tiled_loss.options import LossOptions

#: per-token outputs of return_token_metrics, named in the metrics dict with a "token_" prefix
TOKEN_METRICS = ("ratio", "low_clipped", "high_clipped", "kl", "phi")


def build_metrics(
    sums: dict[str, torch.Tensor],
    token_count: torch.Tensor,
    token_values: dict[str, torch.Tensor],
    opts: LossOptions,
    token_shape: torch.Size,
    has_ref: bool,
) -> dict[str, torch.Tensor]:
    """Means over unmasked tokens (``sum(x * mask) / max(sum(mask), 1)``, as TRL logs them)."""
    denom = token_count.clamp(min=1.0)

    def mean(name: str) -> torch.Tensor:
        return (sums[name] / denom).float()

    metrics: dict[str, torch.Tensor] = {"token_count": token_count.float(), "ratio_mean": mean("ratio")}
    if opts.objective in ("clip", "cispo"):
        low = metrics["clip_frac_low"] = mean("low_clipped")
        metrics["clip_frac_high"] = mean("high_clipped")
        metrics["clip_frac"] = low + metrics["clip_frac_high"]  # the two are disjoint (sign of A)
        if opts.delta is not None:
            metrics["clip_frac_dual"] = mean("dual_clipped")
    if has_ref:
        metrics["kl_mean"] = mean("kl")
    if opts.needs_entropy:
        metrics["entropy_mean"] = mean("entropy")
    if opts.objective == "vespo":
        metrics["vespo_phi_mean"] = mean("phi")
    if opts.return_logps:
        metrics["logps"] = token_values["logps"].float().reshape(token_shape)
    if opts.return_entropy:
        metrics["entropy"] = token_values["entropy"].float().reshape(token_shape)
    if opts.return_token_metrics:
        applicable = {
            "ratio": True,
            "low_clipped": opts.objective in ("clip", "cispo"),
            "high_clipped": opts.objective in ("clip", "cispo"),
            "kl": has_ref,
            "phi": opts.objective == "vespo",
        }
        for name in TOKEN_METRICS:
            if applicable[name]:
                metrics[f"token_{name}"] = token_values[name].float().reshape(token_shape)
    return metrics
