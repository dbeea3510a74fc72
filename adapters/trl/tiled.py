"""Tiled lm-head loss for TRL's GRPOTrainer (``tiled_loss=True`` or ``"auto"``; TRL 1.16).

Wraps ``GRPOTrainer.compute_loss``. TRL's ``_compute_loss`` still runs, so every metric it
logs (entropy, clip ratios, KL, cispo / vespo metrics, policy loss, aux loss) and the loss
value are TRL's own; only its policy forward is answered differently (as the micro-step's
:class:`~.state.LossCall` tells :mod:`.policy_forward`): TRL's log-prob method runs with a
stand-in model that stops at the backbone's last hidden state (:class:`LastHidden`; through
the wrapped model, so DDP / FSDP hooks fire, multimodal inputs cut by TRL, the MoE aux loss
from the model itself). The hidden states and
the lm-head weight go to the ``grpo_lm_head_loss`` hook, which returns the policy loss with
TRL's normalisation and the per-token log-probs / entropies. TRL gets those detached; the
step's loss is TRL's value with the tiled loss's gradient (plus whatever TRL's own terms keep
differentiable: the router aux loss).

The loss's options (TRL's normalisers from the whole micro-batch, the model's logit
transforms) come from :mod:`.tiled_options`; ``top_entropy_quantile < 1`` takes the
entropies from a no-grad tiled pass (``grpo_lm_head_token_stats``) and TRL's own
``get_high_entropy_mask``, passed on as ``policy_token_mask``. Whatever the tiled loss does not
reproduce (a loss type it does not know, a subclass that overrides the loss, a model without a
separate backbone) is refused with one clear error when the trainer is built
(``tiled_loss=True``), or leaves that trainer on TRL's own loss path with the reason in
``status()`` (``"auto"``).
"""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any, Callable, Mapping

from grpo_patches.call_args import bind

from . import FRAMEWORK, dropped_micro_batches, metrics, overrides, placeholders, state
from .loss_modes import LOSS_TYPES, loss_mask
from .tiled_options import logit_transform, loss_options


def unsupported(trainer: Any) -> list[str]:
    """What about ``trainer`` the tiled loss cannot reproduce (empty: nothing)."""
    problems = []
    why = overrides.why_off(trainer, "tiled_loss")
    if why is not None:
        problems.append(why + " (a loss the tiled loss does not compute)")
    if trainer.loss_type not in LOSS_TYPES:
        problems.append(f"loss_type={trainer.loss_type!r} (supported: {', '.join(LOSS_TYPES)})")
    core, backbone = backbone_of(trainer, trainer.model)
    if backbone is core:
        problems.append(f"{type(core).__name__} has no separate backbone (base_model)")
    return problems


def decide(trainer: Any) -> bool:
    """Whether the tiled loss runs for ``trainer`` (decided once, when it is built).

    :raises IncompatibleOptionsError: ``tiled_loss=True`` with something it cannot reproduce.
    """
    own = state.of(trainer)
    if own.tiled_on is None:
        problems = unsupported(trainer)
        own.tiled_on = not problems or FRAMEWORK.refuse_or_note("tiled_loss", problems, owner=trainer)
    return own.tiled_on


def backbone_of(trainer: Any, model: Any) -> tuple[Any, Any]:
    """``(causal LM, its backbone)`` under the DDP/FSDP/PEFT wrappers; the backbone is what
    TRL's fused head runs (``base_model``: the language model of a VLM too). The backbone is
    the causal LM itself for a model without a separate one (:func:`unsupported` refuses it)."""
    core = trainer.accelerator.unwrap_model(model)
    if hasattr(core, "get_base_model"):  # PEFT
        core = core.get_base_model()
    return core, getattr(core, "base_model", core)


def _token_stats(trainer: Any, hidden: Any, head: Any, labels: Any, mask: Any, options: Mapping[str, Any]) -> Any:
    """The entropies of every token, from a no-grad tiled pass (the high-entropy mask's input)."""
    from grpo_patches.plugins import hook

    stats = {name: options[name] for name in ("temperature", "logit_scale", "logit_softcap", "tile_size")
             if name in options}
    return hook().grpo_lm_head_token_stats(hidden=hidden, weight=head.weight, labels=labels, mask=mask,
                                           options={**stats, "bias": head.bias})[1]


def make_tiled_rows(inputs: Mapping[str, Any]) -> Callable[..., tuple]:
    """The :class:`~.state.LossCall` ``tiled`` callback for one micro-batch's ``inputs``."""

    def tiled_rows(trainer: Any, method: Callable[..., Any], arguments: Mapping[str, Any], rows: Any) -> tuple:
        from grpo_patches.plugins import hook

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


class LastHidden:
    """A stand-in for the model in TRL's log-prob method: the real (DDP/FSDP-wrapped) model run
    with ``logits_to_keep=1`` (one position through the lm-head); a forward hook catches the
    backbone's last hidden state for the tiled loss, and TRL gets zero log-probs (never read)
    and the model's own aux loss."""

    def __init__(self, model: Any, backbone: Any) -> None:
        self.model, self.backbone = model, backbone
        self.hidden: list[Any] = []

    def __call__(self, *, labels: Any = None, fused_lm_head: bool = False, **inputs: Any) -> Any:
        caught: dict[str, Any] = {}

        def catch(module: Any, args: Any, output: Any) -> None:
            caught["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

        handle = self.backbone.register_forward_hook(catch)
        try:
            out = self.model(**inputs, logits_to_keep=1, use_cache=False)
        finally:
            handle.remove()
        hidden = caught["hidden"]
        self.hidden.append(hidden)
        zeros = hidden.new_zeros(hidden.shape[:2], dtype=hidden.dtype).float()
        return SimpleNamespace(log_probs=zeros, entropy=zeros, aux_loss=getattr(out, "aux_loss", None), logits=None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def compute_loss(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``GRPOTrainer.compute_loss(model, inputs, ...)``."""
    if instance is None or not instance.model.training:
        return wrapped(*args, **kwargs)  # evaluation keeps TRL's loss (no backward there)
    if not FRAMEWORK.on("tiled_loss") or not decide(instance):  # verification may switch it off
        return wrapped(*args, **kwargs)
    arguments = bind(wrapped, args, kwargs)
    if FRAMEWORK.on("pack_kept_rows") and dropped_micro_batches.skipped(instance, arguments["inputs"]):
        return wrapped(*args, **kwargs)  # no kept row: the filter inside answers it without a forward
    # the deferred pass's placeholders of zero-advantage rows (the filter inside judges the others)
    inputs = placeholders.guard(arguments["inputs"], strict=False)
    with state.LOSS.joined(state.LossCall) as call:
        call.tiled = make_tiled_rows(inputs)
        call.packed = dropped_micro_batches.dealt(instance, arguments["inputs"])
        loss = arguments.call(wrapped, inputs=inputs)  # TRL's value; its policy terms carry no gradient
        if call.tiled_loss is None:
            raise RuntimeError(
                "grpo_patches: tiled_loss found no policy forward in GRPOTrainer._compute_loss "
                "(TRL's internals moved?); pass tiled_loss=False"
            )
    calls = metrics.add_count(instance, "tiled_loss_calls", 1, log=False)
    FRAMEWORK.note("tiled_loss", f"on: {int(calls)} loss calls computed tile by tile", owner=instance)
    return loss + (call.tiled_loss - call.tiled_loss.detach())
