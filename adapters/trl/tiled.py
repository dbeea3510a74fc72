"""Tiled lm-head loss for TRL's GRPOTrainer (``tiled_loss=True`` or ``"auto"``; TRL 1.16).

Wraps ``GRPOTrainer.compute_loss``. TRL's ``_compute_loss`` still runs, so every metric it
logs (entropy, clip ratios, KL, cispo / vespo metrics, policy loss, aux loss) and the loss
value are TRL's own; only its policy forward is answered differently (:mod:`.policy_forward`):
TRL's log-prob method runs with a stand-in model that stops at the backbone's last hidden
state (:class:`~.row_subsets.LastHidden`; through the wrapped model, so DDP / FSDP hooks fire,
multimodal inputs cut by TRL, the MoE aux loss from the model itself). The hidden states and
the lm-head weight go to the ``grpo_lm_head_loss`` hook, which returns the policy loss with
TRL's normalisation and the per-token log-probs / entropies. TRL gets those detached; the
step's loss is TRL's value with the tiled loss's gradient (plus whatever TRL's own terms keep
differentiable: the router aux loss).

Model logit transforms are applied as TRL's fused head applies them (:func:`logit_transform`);
``top_entropy_quantile < 1`` takes the entropies from a no-grad tiled pass
(``grpo_lm_head_token_stats``) and TRL's own ``get_high_entropy_mask``, passed on as
``policy_token_mask``. TRL's normalisers (1.16) are passed explicitly, computed from the whole
micro-batch, so the tiled loss of a row subset (with the zero-advantage filter) keeps every
denominator. Whatever the tiled loss does not reproduce (a loss type it does not know, a
subclass that overrides the loss, a model without a separate backbone) is refused with one
clear error when the trainer is built (``tiled_loss=True``), or leaves that trainer on TRL's
own loss path with the reason in ``status()`` (``"auto"``).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Mapping

from grpo_patches import api
from grpo_patches.errors import IncompatibleOptionsError

from . import metrics, overrides, state
from .policy_forward import loss_call, loss_mask
from .loss_types import denominator



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


def unsupported(trainer: Any) -> list[str]:
    """What about ``trainer`` the tiled loss cannot reproduce (empty: nothing)."""
    from grpo_patches.tiled_loss import TRL_LOSS_TYPES

    problems = []
    why = overrides.why_off(trainer, "tiled_loss")
    if why is not None:
        problems.append(why + " (a loss the tiled loss does not compute)")
    if trainer.loss_type not in TRL_LOSS_TYPES:
        problems.append(f"loss_type={trainer.loss_type!r} (supported: {', '.join(TRL_LOSS_TYPES)})")
    try:
        backbone_of(trainer, trainer.model)
    except IncompatibleOptionsError as exc:
        problems.append(str(exc))
    return problems


def _refuse_or_note(trainer: Any, problems: list[str]) -> bool:
    """``tiled_loss=True``: raise naming every problem; ``"auto"``: note them, return False."""
    if api.strict("trl", "tiled_loss"):
        raise IncompatibleOptionsError(
            "tiled_loss=True cannot reproduce TRL's loss with: " + "; ".join(problems)
            + ". Change the setting, or pass tiled_loss='auto' (TRL's own loss path there) or False to "
            "grpo_patches.enable(...)"
        )
    api.note("trl", "tiled_loss", "off, TRL's own loss path: " + "; ".join(problems), owner=trainer)
    return False


def decide(trainer: Any) -> bool:
    """Whether the tiled loss runs for ``trainer`` (decided once, when it is built).

    :raises IncompatibleOptionsError: ``tiled_loss=True`` with something it cannot reproduce.
    """
    own = state.of(trainer)
    if own.tiled_on is None:
        problems = unsupported(trainer)
        own.tiled_on = not problems or _refuse_or_note(trainer, problems)
    return own.tiled_on


def _normalizer(trainer: Any, inputs: Mapping[str, Any], mask: Any) -> float | Any:
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
        loss_type=trainer.loss_type,
        epsilon_low=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high,
        delta=args.delta,
        importance_sampling_level=trainer.importance_sampling_level,
        off_policy_mask_threshold=trainer.off_policy_mask_threshold,
        beta=trainer.beta,
        kl_estimator="k3",
        kl_ratio_correction=bool(getattr(args, "use_bias_correction_kl", False)),
        normalizer=_normalizer(trainer, inputs, mask),
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
    tile_size = getattr(api.active_options("trl"), "tile_size", None)
    if tile_size is not None:
        options["tile_size"] = tile_size

    def per_row(name: str) -> Any:
        value = inputs.get(name)
        return None if value is None else value[rows]

    options["old_logps"] = per_row("old_per_token_logps")
    if trainer.beta != 0.0:
        options["ref_logps"] = per_row("ref_per_token_logps")
    if trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        options["is_weights"] = per_row("importance_sampling_ratio")
    if trainer.off_policy_mask_threshold is not None and inputs.get("sampling_per_token_logps") is not None:
        options["sampling_logps"] = per_row("sampling_per_token_logps")
    return options


def backbone_of(trainer: Any, model: Any) -> tuple[Any, Any]:
    """``(causal LM, its backbone)`` under the DDP/FSDP/PEFT wrappers; the backbone is what
    TRL's fused head runs (``base_model``: the language model of a VLM too)."""
    core = trainer.accelerator.unwrap_model(model)
    if hasattr(core, "get_base_model"):  # PEFT
        core = core.get_base_model()
    backbone = getattr(core, "base_model", core)
    if backbone is core:
        raise IncompatibleOptionsError(f"{type(core).__name__} has no separate backbone (base_model)")
    return core, backbone


def _token_stats(trainer: Any, hidden: Any, head: Any, labels: Any, mask: Any, options: Mapping[str, Any]) -> Any:
    """The entropies of every token, from a no-grad tiled pass (the high-entropy mask's input)."""
    from grpo_patches.plugins import hook

    stats = {name: options[name] for name in ("temperature", "logit_scale", "logit_softcap", "tile_size")
             if name in options}
    return hook().grpo_lm_head_token_stats(hidden=hidden, weight=head.weight, labels=labels, mask=mask,
                                           options={**stats, "bias": head.bias})[1]


def make_tiled_rows(inputs: Mapping[str, Any]) -> Callable[..., tuple]:
    """The :class:`~.policy_forward.LossCall` ``tiled`` callback for one micro-batch's ``inputs``."""

    def tiled_rows(trainer: Any, method: Callable[..., Any], arguments: Mapping[str, Any], rows: Any) -> tuple:
        from grpo_patches.plugins import hook

        from .row_subsets import LastHidden

        core, backbone = backbone_of(trainer, trainer.model)
        stand_in = LastHidden(arguments["model"], backbone)
        _, _, aux = method(**{**arguments, "model": stand_in, "compute_entropy": False})
        width = int(arguments["logits_to_keep"])
        hidden = torch_cat(stand_in.hidden)[:, -width - 1 : -1]  # position t predicts token t + 1
        if trainer.args.cast_lm_head_to_fp32:
            hidden = hidden.float()
        head = core.get_output_embeddings()
        labels = arguments["input_ids"][:, -width:]
        mask = loss_mask(inputs)[rows]
        options = {**loss_options(trainer, inputs, rows), **logit_transform(core.config.get_text_config())}
        try:
            from trl.trainer.utils import maybe_gather_lm_head_ctx  # ZeRO-3: gather the head once
        except ImportError:  # pragma: no cover - older TRL
            gather = nullcontext()
        else:
            gather = maybe_gather_lm_head_ctx(head.weight, head.bias)
        entropies = None
        with gather:
            quantile = getattr(trainer, "top_entropy_quantile", 1.0)
            if quantile < 1.0:  # TRL's mask from these entropies, as TRL would from its own
                entropies = _token_stats(trainer, hidden, head, labels, mask, options)
                entropy_mask = trainer.get_high_entropy_mask(entropies, mask, 1 - quantile).to(hidden.dtype)
                options["policy_token_mask"] = entropy_mask
                if "entropy_coef" in options:  # TRL's bonus: a mean over the masked tokens only
                    options["entropy_token_mask"] = entropy_mask
                    options["entropy_normalizer"] = (
                        (mask * entropy_mask).sum().clamp(min=1.0) * trainer.current_gradient_accumulation_steps
                    )
            loss, values = hook().grpo_lm_head_loss(
                hidden=hidden, weight=head.weight, labels=labels, advantages=inputs["advantages"][rows],
                mask=mask, options={**options, "bias": head.bias},
            )
        return loss, values["logps"], values.get("entropy") if entropies is None else entropies, aux

    return tiled_rows


def torch_cat(tensors: list) -> Any:
    import torch

    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def compute_loss_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``GRPOTrainer.compute_loss(model, inputs, ...)``."""
    inputs = kwargs["inputs"] if "inputs" in kwargs else args[1]
    if instance is None or not instance.model.training or not decide(instance):
        return wrapped(*args, **kwargs)  # evaluation keeps TRL's loss (no backward there)
    with loss_call(instance) as call:
        call.tiled = make_tiled_rows(inputs)
        loss = wrapped(*args, **kwargs)  # TRL's value; its policy terms carry no gradient
        if call.tiled_loss is None:
            raise RuntimeError(
                "grpo_patches: tiled_loss found no policy forward in GRPOTrainer._compute_loss "
                "(TRL's internals moved?); pass tiled_loss=False"
            )
    calls = metrics.add_count(instance, "tiled_loss_calls", 1, log=False)
    api.note("trl", "tiled_loss", f"on: {int(calls)} loss calls computed tile by tile", owner=instance)
    return loss + (call.tiled_loss - call.tiled_loss.detach())
