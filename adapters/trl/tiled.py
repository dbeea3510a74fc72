"""Tiled lm-head loss for TRL's GRPOTrainer (``tiled_loss=True``; TRL 1.16).

Wraps ``GRPOTrainer.compute_loss``. TRL's ``_compute_loss`` still runs, so every metric it
logs (entropy, clip ratios, KL, cispo / vespo metrics, policy loss) is computed by TRL's own
code; only its policy forward is answered differently (:mod:`.loss_rows`): the backbone runs
once (through the wrapped model, so DDP / FSDP hooks fire), its last hidden states and the
lm-head weight go to the ``grpo_lm_head_loss`` hook, which returns the loss with TRL's
normalisation and the per-token log-probs / entropies. TRL receives those detached for its
metrics; the loss it then computes carries no gradient and is replaced by the tiled one.

TRL's normalisers (1.16) are passed explicitly, computed from the whole micro-batch, so the
tiled loss of a row subset (with the zero-advantage filter) keeps every denominator.
Whatever the tiled loss does not reproduce (a setting, a model's logit transform, a subclass
that overrides the loss) is refused with one clear error when the trainer is built
(``tiled_loss=True``), or leaves that trainer on TRL's own loss path with the reason in
``status()`` (``"auto"``).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Mapping

from grpo_patches import api
from grpo_patches.errors import IncompatibleOptionsError

from . import metrics, overrides, state
from .loss_rows import MULTIMODAL_KEYS, loss_call, loss_mask
from .loss_types import denominator

#: Config attributes of logit transforms the tiled loss does not apply (TRL's fused head does).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling")


def unsupported(trainer: Any) -> list[str]:
    """What about ``trainer`` the tiled loss cannot reproduce (empty: nothing)."""
    from grpo_patches.tiled_loss import TRL_LOSS_TYPES

    problems = []
    why = overrides.why_off(trainer, "tiled_loss")
    if why is not None:
        problems.append(why + " (a loss the tiled loss does not compute)")
    if trainer.loss_type not in TRL_LOSS_TYPES:
        problems.append(f"loss_type={trainer.loss_type!r} (supported: {', '.join(TRL_LOSS_TYPES)})")
    if getattr(trainer, "top_entropy_quantile", 1.0) != 1.0:
        problems.append(f"top_entropy_quantile={trainer.top_entropy_quantile} (the entropy mask; use 1.0)")
    if getattr(trainer, "aux_loss_enabled", False):
        problems.append("a MoE router aux loss (router_aux_loss_coef != 0)")
    text_config = trainer.model.config.get_text_config()
    for name in _LOGIT_TRANSFORMS:
        value = getattr(text_config, name, None)
        if value is not None and not (name == "logit_scale" and value == 1.0):
            problems.append(f"model config {name}={value} (a logit transform the tiled loss does not apply)")
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


def _last_hidden(trainer: Any, model: Any, bound: Mapping[str, Any], rows: Any) -> Any:
    """The backbone's last hidden states of ``rows``, from a forward through ``model``.

    The call goes through the (DDP/FSDP-)wrapped model with ``logits_to_keep=1`` (one
    position's logits); a forward hook on the backbone catches ``last_hidden_state``.
    """
    core = trainer.accelerator.unwrap_model(model)
    if hasattr(core, "get_base_model"):  # PEFT
        core = core.get_base_model()
    backbone = core.base_model
    if backbone is core:
        raise IncompatibleOptionsError(
            f"tiled_loss=True needs a causal LM with a separate backbone; {type(core).__name__} has none. "
            "Pass tiled_loss=False to grpo_patches.enable(...)"
        )
    captured: dict[str, Any] = {}

    def catch(module: Any, args: Any, output: Any) -> None:
        captured["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    model_inputs = {"input_ids": bound["input_ids"][rows], "attention_mask": bound["attention_mask"][rows]}
    for name in ("token_type_ids", "mm_token_type_ids"):
        if bound.get(name) is not None:
            model_inputs[name] = bound[name][rows]
    handle = backbone.register_forward_hook(catch)
    try:
        with trainer.accelerator.autocast():
            model(**model_inputs, logits_to_keep=1, use_cache=False)
    finally:
        handle.remove()
    return captured["hidden"], core


def make_tiled_rows(inputs: Mapping[str, Any]) -> Callable[[Any, Mapping[str, Any], Any], tuple]:
    """The :class:`~.loss_rows.LossCall` ``tiled`` callback for one micro-batch's ``inputs``."""

    def tiled_rows(trainer: Any, bound: Mapping[str, Any], rows: Any) -> tuple:
        from grpo_patches.plugins import hook

        options = loss_options(trainer, inputs, rows)
        width = int(bound["logits_to_keep"])
        hidden, core = _last_hidden(trainer, bound["model"], bound, rows)
        hidden = hidden[:, -width - 1 : -1]  # position t predicts token t + 1
        if trainer.args.cast_lm_head_to_fp32:
            hidden = hidden.float()
        head = core.get_output_embeddings()
        try:
            from trl.trainer.utils import maybe_gather_lm_head_ctx  # ZeRO-3: gather the head once
        except ImportError:  # pragma: no cover - older TRL
            gather = nullcontext()
        else:
            gather = maybe_gather_lm_head_ctx(head.weight, head.bias)
        with gather:
            loss, values = hook().grpo_lm_head_loss(
                hidden=hidden,
                weight=head.weight,
                labels=bound["input_ids"][rows][:, -width:],
                advantages=inputs["advantages"][rows],
                mask=loss_mask(inputs)[rows],
                options={**options, "bias": head.bias},
            )
        return loss, values["logps"], values.get("entropy")

    return tiled_rows


def compute_loss_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``GRPOTrainer.compute_loss(model, inputs, ...)``."""
    inputs = kwargs["inputs"] if "inputs" in kwargs else args[1]
    if instance is None or not instance.model.training or not decide(instance):
        return wrapped(*args, **kwargs)  # evaluation keeps TRL's loss (no backward there)
    if any(inputs.get(key) is not None for key in MULTIMODAL_KEYS):
        state.of(instance).tiled_on = _refuse_or_note(instance, ["multimodal inputs"])
        return wrapped(*args, **kwargs)
    with loss_call(instance) as call:
        call.tiled = make_tiled_rows(inputs)
        wrapped(*args, **kwargs)  # TRL's loss from detached values: metrics only
        if call.tiled_loss is None:
            raise RuntimeError(
                "grpo_patches: tiled_loss found no policy forward in GRPOTrainer._compute_loss "
                "(TRL's internals moved?); pass tiled_loss=False"
            )
    calls = metrics.add_count(instance, "tiled_loss_calls", 1, log=False)
    api.note("trl", "tiled_loss", f"on: {int(calls)} loss calls computed tile by tile", owner=instance)
    return call.tiled_loss
