"""Keyword options of the GRPO lm-head loss, validated once and shared by the tiled and dense paths.

The loss is ``objective`` (how one token's loss depends on its log-prob) combined with
``aggregation`` (how per-token losses become one number), in the core's own vocabulary; each
adapter maps its framework's loss names onto them (TRL's ``loss_type`` names: the TRL
adapter's ``loss_modes.tiled_loss_preset``). The defaults, ``"clip"`` and ``"token-mean"``,
are the PPO-clip objective over the micro-batch's tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from grpo_patches.errors import OptionError

OBJECTIVES = ("clip", "cispo", "sapo", "vespo")
AGGREGATIONS = (
    "token-mean",  # TRL bnpo/dapo/cispo/vespo, verl token-mean, NeMo token level (normalizer=global tokens)
    "seq-mean-token-mean",  # TRL grpo/sapo, verl seq-mean-token-mean, NeMo sequence level (normalizer=global seqs)
    "seq-mean-token-sum",  # TRL luspo, verl seq-mean-token-sum
    "seq-mean-token-sum-norm",  # TRL dr_grpo (rows * max_completion_length), verl seq-mean-token-sum-norm
    "token-sum",  # plain masked sum (the caller divides)
)
ROW_AGGREGATIONS = ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
IS_LEVELS = ("token", "sequence")

#: Default fp32 logits-tile budget: 512 MiB is ~880 tokens at vocab 151936.
DEFAULT_TILE_MEMORY_BYTES = 512 * 2**20


@dataclass(frozen=True)
class LossOptions:
    """Validated options; see :func:`grpo_patches.tiled_loss.tiled_grpo_loss` for each meaning."""

    objective: str = "clip"
    aggregation: str = "token-mean"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    cispo_max_ratio: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    importance_sampling_level: str = "token"
    log_ratio_clamp: float | None = None
    off_policy_mask_threshold: float | None = None
    beta: float = 0.0
    kl_estimator: Any = "k3"  # "k1" / "k2" / "k3", or a callable (logps, ref_logps) -> per-token KL
    kl_clamp: float | None = None
    kl_ratio_correction: bool = False
    entropy_coef: float = 0.0
    entropy_aggregation: str | None = None
    entropy_normalizer: float | None = None
    normalizer: float | None = None
    max_completion_length: int | None = None
    temperature: float = 1.0
    logit_scale: float = 1.0
    logit_softcap: float | None = None
    tile_size: int | None = None
    tile_memory_bytes: int = DEFAULT_TILE_MEMORY_BYTES
    return_logps: bool = False
    return_entropy: bool = False
    return_token_metrics: bool = False
    retain_grads: bool = False

    @property
    def logit_chain(self) -> float:
        """d(logit)/d(raw lm-head output) apart from the softcap's ``1 - tanh^2``: ``logit_scale / temperature``."""
        return self.logit_scale / self.temperature

    @property
    def needs_whole_rows(self) -> bool:
        """True when a token's coefficient depends on its whole sequence (tiles hold whole rows)."""
        return (
            self.importance_sampling_level == "sequence"
            or self.objective == "vespo"
            or self.off_policy_mask_threshold is not None
        )

    @property
    def needs_entropy(self) -> bool:
        return self.return_entropy or self.entropy_coef != 0.0

    @property
    def uses_rows(self) -> bool:
        return self.needs_whole_rows or self.aggregation in ROW_AGGREGATIONS or (
            self.entropy_coef != 0.0 and self.entropy_aggregation in ROW_AGGREGATIONS
        )


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise OptionError(f"{name}={value!r} is not supported; use one of {', '.join(map(repr, allowed))}")
    return value


def resolve_options(**kwargs: Any) -> LossOptions:
    """Build :class:`LossOptions` from keyword arguments.

    :raises OptionError: an unknown option or value, naming the valid ones.
    """
    # TRL's loss_type presets live in the TRL adapter: the core speaks objective / aggregation
    if "loss_type" in kwargs:
        raise OptionError(
            f"loss_type={kwargs['loss_type']!r} is not an option of the tiled loss: pass objective= and aggregation= "
            "(TRL's loss_type names map onto them: grpo_patches.adapters.trl.loss_modes.tiled_loss_preset)"
        )
    known = {f.name for f in fields(LossOptions)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise OptionError(
            f"unknown tiled_grpo_loss option(s) {', '.join(unknown)}; known options: {', '.join(sorted(known))}"
        )
    if kwargs.get("epsilon_high") is None:
        kwargs["epsilon_high"] = kwargs.get("epsilon_low", 0.2)
    opts = LossOptions(**kwargs)
    _choice("objective", opts.objective, OBJECTIVES)
    _choice("aggregation", opts.aggregation, AGGREGATIONS)
    if opts.entropy_aggregation is not None:
        _choice("entropy_aggregation", opts.entropy_aggregation, AGGREGATIONS)
    if not callable(opts.kl_estimator):  # a callable: a framework's own elementwise estimator
        _choice("kl_estimator", opts.kl_estimator, KL_ESTIMATORS)
    _choice("importance_sampling_level", opts.importance_sampling_level, IS_LEVELS)
    if opts.objective == "cispo" and opts.cispo_max_ratio is None:
        raise OptionError("objective='cispo' needs cispo_max_ratio (TRL passes epsilon_high, e.g. 5.0)")
    if not opts.temperature > 0:
        raise OptionError(f"temperature={opts.temperature!r} must be > 0")
    if not math.isfinite(opts.logit_scale):
        raise OptionError(f"logit_scale={opts.logit_scale!r} must be a finite number (1.0: no scaling)")
    if opts.logit_softcap is not None and not (math.isfinite(opts.logit_softcap) and opts.logit_softcap > 0):
        raise OptionError(f"logit_softcap={opts.logit_softcap!r} must be > 0 (Gemma-2's final_logit_softcapping) or None")
    if opts.delta is not None and opts.delta <= 1.0:
        raise OptionError(f"delta={opts.delta!r} (dual-clip ratio cap) must be > 1 (verl's clip_ratio_c, e.g. 3.0)")
    if opts.tile_size is not None and opts.tile_size < 1:
        raise OptionError(f"tile_size={opts.tile_size!r} must be a positive number of tokens (or None)")
    if opts.tile_memory_bytes < 1:
        raise OptionError(f"tile_memory_bytes={opts.tile_memory_bytes!r} must be positive")
    for name in ("normalizer", "entropy_normalizer"):
        value = getattr(opts, name)
        if value is not None and not float(value) > 0:
            raise OptionError(f"{name}={value!r} must be > 0 (or None for the local count)")
    if opts.max_completion_length is not None and opts.max_completion_length < 1:
        raise OptionError(f"max_completion_length={opts.max_completion_length!r} must be >= 1")
    return opts
