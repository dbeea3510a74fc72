"""The ``grpo_lm_head_loss`` options that reproduce TRL 1.16's loss (the tiled loss's input).

Each of TRL's ``loss_type`` names becomes the tiled loss's objective and aggregation
(:func:`.loss_modes.tiled_loss_preset`); TRL's normalisers are passed explicitly, computed from
the whole micro-batch, so the tiled loss of a row subset (with the zero-advantage filter)
keeps every denominator; the model's logit transforms are read as TRL's fused head reads them.
"""

from __future__ import annotations

from typing import Any, Mapping

from . import FRAMEWORK
from .loss_modes import denominator, importance_sampling_on, loss_mask, tiled_loss_preset


def logit_transform(text_config: Any) -> dict[str, Any]:
    """``logit_scale`` / ``logit_softcap`` of the tiled loss, read from the model config as TRL
    1.16's fused head reads them (``trl.trainer.utils.add_fused_lm_head``): the softcap is
    ``final_logit_softcapping`` (Gemma-2/3); the scale the first of ``logit_scale`` (Cohere),
    ``output_multiplier``, ``lm_head_multiplier`` (Falcon-H1), else ``1 / logits_scaling``
    (Granite, MiniCPM3; HyperCLOVA X multiplies by it), else 1."""
    scale = None
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        scale = getattr(text_config, name, None) if scale is None else scale
    scaling = getattr(text_config, "logits_scaling", None)
    if scale is None and scaling is not None:
        scale = scaling if getattr(text_config, "model_type", "") == "hyperclovax" else 1 / scaling
    return {"logit_scale": 1.0 if scale is None else float(scale),
            "logit_softcap": getattr(text_config, "final_logit_softcapping", None)}


def normalizer(trainer: Any, inputs: Mapping[str, Any], mask: Any) -> float | Any:
    """TRL 1.16's denominator of the whole micro-batch, times its accumulation factor."""
    accumulation = trainer.current_gradient_accumulation_steps
    kind = denominator(trainer.loss_type)  # the one table of TRL's denominators
    if kind == "fixed":  # dapo / cispo / vespo: num_items_in_batch
        items = inputs["num_items_in_batch"].clamp(min=1.0) / trainer.accelerator.num_processes
        return items * accumulation / trainer.args.steps_per_generation
    if kind == "tokens":  # bnpo: the micro-batch's tokens
        return mask.sum().clamp(min=1.0) * accumulation
    return float(mask.shape[0] * accumulation)  # row aggregations: every row of the micro-batch


def loss_options(trainer: Any, inputs: Mapping[str, Any], rows: Any) -> dict[str, Any]:
    """The ``grpo_lm_head_loss`` options reproducing TRL 1.16's loss for ``rows`` of ``inputs``
    (normalised by the whole micro-batch, so a row subset keeps every denominator)."""
    args = trainer.args
    mask = loss_mask(inputs)
    options: dict[str, Any] = dict(
        **tiled_loss_preset(trainer.loss_type, trainer.epsilon_high),
        epsilon_low=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high,
        delta=args.delta,
        importance_sampling_level=trainer.importance_sampling_level,
        off_policy_mask_threshold=trainer.off_policy_mask_threshold,
        beta=trainer.beta,
        kl_estimator="k3",
        kl_ratio_correction=bool(getattr(args, "use_bias_correction_kl", False)),
        normalizer=normalizer(trainer, inputs, mask),
        max_completion_length=trainer.max_completion_length,
        temperature=trainer.temperature,
        return_logps=True,
        return_entropy=True,
    )
    if trainer.loss_type == "sapo":
        options.update(sapo_temperature_pos=args.sapo_temperature_pos, sapo_temperature_neg=args.sapo_temperature_neg)
    if trainer.loss_type == "vespo":
        options.update(
            vespo_k_pos=args.vespo_k_pos,
            vespo_lambda_pos=args.vespo_lambda_pos,
            vespo_k_neg=args.vespo_k_neg,
            vespo_lambda_neg=args.vespo_lambda_neg,
        )
    if getattr(trainer, "_entropy_bonus_enabled", False):
        coef = trainer.entropy_coef
        if trainer.use_adaptive_entropy:  # TRL applies the coefficient of the previous optimizer step
            coef = coef if trainer._last_world_entropy <= args.entropy_target else 0.0
        options.update(
            entropy_coef=coef,
            entropy_aggregation="token-mean",
            entropy_normalizer=mask.sum().clamp(min=1.0) * trainer.current_gradient_accumulation_steps,
        )
    tile_size = FRAMEWORK.setting("tile_size")
    if tile_size is not None:
        options["tile_size"] = tile_size

    def per_row(name: str) -> Any:
        value = inputs.get(name)
        return None if value is None else value[rows]

    options["old_logps"] = per_row("old_per_token_logps")
    if trainer.beta != 0.0:
        options["ref_logps"] = per_row("ref_per_token_logps")
    if importance_sampling_on(trainer):
        options["is_weights"] = per_row("importance_sampling_ratio")
    if trainer.off_policy_mask_threshold is not None and inputs.get("sampling_per_token_logps") is not None:
        options["sampling_logps"] = per_row("sampling_per_token_logps")
    return options
