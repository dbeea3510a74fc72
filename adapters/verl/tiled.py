"""Tiled lm-head loss for verl's actor (option ``tiled_loss``), shared by both code lines.

verl exposes the last hidden state in one place: its fused-kernel forward
(``model.use_fused_kernels=True``; ``models/transformers/dense_common.py`` and the VLM
variants) calls ``FusedLinearForPPO.forward(hidden_states, vocab_weights=self.lm_head.weight,
input_ids=<rolled labels>, temperature)`` inside the model's (FSDP-wrapped) forward, where
the lm-head weight is the unsharded one verl itself uses. This module answers that call for a
training micro-batch:

1. the line's wrapper (:mod:`.tiled_legacy`: ``_forward_micro_batch``; :mod:`.tiled_engine`:
   ``forward_step``) describes the micro-batch in a :class:`~.state.TiledCall` before the forward
   (``MicroBatchCall.tiled``, :mod:`.state`):
   where each response token's hidden state sits in the model's layout (padded or packed),
   the per-token inputs of verl's policy loss, and each token's aggregation weight, taken as
   the gradient of verl's own ``agg_loss`` (any ``loss_agg_mode``, global counts included);
2. :func:`forward` (wrapping ``FusedLinearForPPO.forward``) computes the loss
   from the response tokens' hidden states and the weight through the ``grpo_lm_head_loss``
   hook, tile by tile (never ``[tokens, vocab]`` logits, prompt tokens never projected), and
   returns detached log-probs / entropies in verl's layout;
3. :mod:`.tiled_policy_loss` (wrapping the ``get_policy_loss_fn`` binding verl's loss code
   calls) hands verl a policy-loss function that runs verl's own on those detached values (so
   every metric, and the loss value, is verl's) and returns ``tiled - tiled.detach() + verl's
   value``: verl's value, the tiled loss's gradient. Before that it checks that verl's loss
   received exactly the inputs the tiled loss used (else a clear error: verl's internals moved).

The tiled loss reproduces ``policy_loss.loss_mode="vanilla"`` (verl's dual-clip PPO:
``clip_ratio_low/high``, ``clip_ratio_c``, the log-ratio clamp at 20), ``rollout_is_weights``,
the entropy bonus and the KL loss (verl's own ``kl_penalty``, called per tile). Anything
else: a clear error for ``tiled_loss=True``, verl's own path with the reason in ``status()``
for ``"auto"``.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import bind
from grpo_patches.verify_fp32_head import tiled_aside

from . import FRAMEWORK, state
from .loss_modes import loss_mode_of
from .state import TiledCall

#: The policy loss the tiled loss reproduces (verl's vanilla PPO loss is dual-clip).
LOSS_MODES = ("vanilla",)
#: verl clamps the log-ratio before exp in the vanilla loss (core_algos.compute_policy_loss_vanilla).
LOG_RATIO_CLAMP = 20.0


def enabled() -> bool:
    return FRAMEWORK.on("tiled_loss")


def decide(owner: Any, problems: list[str]) -> bool:
    """Whether the tiled loss runs for ``owner`` (an actor or engine), decided once.

    :raises grpo_patches.errors.IncompatibleOptionsError: ``tiled_loss=True`` and a setting it
        cannot reproduce.
    """
    own = state.of(owner)
    if own.tiled_decided:
        return own.tiled
    on = enabled()
    if on and problems:
        on = FRAMEWORK.refuse_or_note("tiled_loss", f"it cannot reproduce verl's loss with {'; '.join(problems)}",
                                      owner=owner)
    elif on:
        FRAMEWORK.note("tiled_loss", "on: the policy loss comes from the last hidden state and the lm-head "
                       "weight, tile by tile (no [tokens, vocab] logits)", owner=owner)
    own.tiled, own.tiled_decided = on, True
    return on


def decline(owner: Any, why: str, scope: str = "an update") -> None:
    """This ``scope`` runs verl's own path: an error for ``tiled_loss=True``, a status note for ``"auto"``."""
    FRAMEWORK.refuse_or_note("tiled_loss", f"{scope} runs verl's own loss: {why}", owner=owner)


def config_problems(config: Any, *, fused: bool, backend: str | None, sp: int) -> list[str]:
    """Actor settings the tiled loss cannot reproduce, each with its fix."""
    problems = []
    mode = loss_mode_of(config)
    if mode not in LOSS_MODES:
        problems.append(f"actor.policy_loss.loss_mode={mode!r} (the tiled loss reproduces 'vanilla', verl's "
                        "dual-clip PPO loss)")
    if not fused:
        problems.append("actor_rollout_ref.model.use_fused_kernels=False (the tiled loss takes the last hidden state "
                        "from verl's fused-kernel forward: set use_fused_kernels=True, "
                        "fused_kernel_options.impl_backend=torch)")
    elif backend not in (None, "torch", "liger"):
        problems.append(f"fused_kernel_options.impl_backend={backend!r} (its forward never calls FusedLinearForPPO; "
                        "use 'torch')")
    if sp > 1:
        problems.append(f"ulysses_sequence_parallel_size={sp} (hidden states split over ranks; use 1)")
    if getattr(config, "use_prefix_grouper", False):
        problems.append("actor.use_prefix_grouper=True (a grouped forward; set it to False)")
    if config.get("calculate_sum_pi_squared", False):
        problems.append("actor.calculate_sum_pi_squared=True (it needs full logits)")
    return problems


def fused_backend(model: Any) -> str | None:
    """The fused-kernel backend verl patched the model's class with (``None``: unknown)."""
    inner = getattr(model, "_fsdp_wrapped_module", model)
    backend = getattr(inner, "_verl_fused_kernels_backend", None)
    if backend is not None:
        return backend
    name = getattr(type(inner).forward, "__name__", "")
    return "triton" if name == "forward_with_triton_backend" else None


def global_batch_info(config: Any) -> dict:
    """The global counts verl's ``agg_loss`` divides by (0.6 has neither the field nor the arguments)."""
    return dict(getattr(config, "global_batch_info", None) or {})


def token_weights(mask: Any, loss_agg_mode: str, info: dict) -> Any:
    """Each token's weight in verl's ``agg_loss`` (the gradient of a linear map: exact for every mode)."""
    import torch
    from verl.trainer.ppo.core_algos import agg_loss

    with torch.enable_grad():
        probe = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device, requires_grad=True)
        out = agg_loss(loss_mat=probe, loss_mask=mask, loss_agg_mode=loss_agg_mode, **info)
        (weights,) = torch.autograd.grad(out, probe)
    return torch.nan_to_num(weights.detach(), nan=0.0, posinf=0.0, neginf=0.0)


def forward(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``FusedLinearForPPO.forward(hidden_states, vocab_weights, input_ids, temperature)``:
    the training micro-batch's tiled loss (``MicroBatchCall.tiled``)."""
    import torch

    call = state.micro_batch().tiled
    if call is None or call.loss is not None or call.declined or not torch.is_grad_enabled() or tiled_aside():
        return wrapped(*args, **kwargs)
    given = bind(wrapped, args, kwargs)
    out = compute(call, given["hidden_states"], given["vocab_weights"], given["input_ids"], float(given["temperature"]))
    if out is None:
        return wrapped(*args, **kwargs)
    return out


def _loss_options(call: TiledCall, temperature: float) -> dict:
    config = call.config
    clip = config.clip_ratio
    low = config.clip_ratio_low if config.clip_ratio_low is not None else clip
    high = config.clip_ratio_high if config.clip_ratio_high is not None else clip
    options = dict(objective="clip", aggregation="token-sum", epsilon_low=low, epsilon_high=high,
                   delta=float(config.get("clip_ratio_c", 3.0)), log_ratio_clamp=LOG_RATIO_CLAMP,
                   temperature=temperature, return_logps=True, return_entropy=call.calculate_entropy)
    tile = FRAMEWORK.setting("tile_size")
    if tile is not None:
        options["tile_size"] = tile
    if call.calculate_entropy and float(config.entropy_coeff or 0.0) != 0.0:
        options["entropy_coef"] = float(config.entropy_coeff)
    if config.use_kl_loss and float(config.kl_loss_coef) != 0.0:
        from verl.trainer.ppo.core_algos import kl_penalty

        kind = config.kl_loss_type
        options["beta"] = float(config.kl_loss_coef)
        options["kl_estimator"] = lambda logps, ref: kl_penalty(logprob=logps, ref_logprob=ref, kl_penalty=kind)
    return options


def compute(call: TiledCall, hidden: Any, weight: Any, input_ids: Any, temperature: float) -> Any:
    import torch

    from grpo_patches.plugins import hook

    device = hidden.device
    inputs = call.inputs()
    mask = inputs["response_mask"].to(device) != 0
    positions = call.positions(tuple(hidden.shape[:-1]))
    if positions is None:
        call.declined = f"hidden states of shape {tuple(hidden.shape)} do not match the micro-batch's layout"
        return None
    index = positions.to(device)[mask]
    labels = input_ids.reshape(-1).to(device)[index].long()
    if call.responses is not None and not torch.equal(labels, call.responses.to(device)[mask].long()):
        raise RuntimeError("grpo_patches: tiled_loss mapped verl's response tokens to the wrong positions "
                           "(verl's internals moved?); pass tiled_loss=False to grpo_patches.enable(...)")
    weights = call.weights.to(device)
    if call.rows is not None:
        weights = weights[call.rows.to(device)]

    def sel(name: str) -> Any:
        value = inputs.get(name)
        return None if value is None else value.to(device)[mask].float()

    options = _loss_options(call, temperature)
    per_token = {"old_logps": sel("old_log_probs"), "is_weights": sel("rollout_is_weights")}
    if "beta" in options:
        per_token["ref_logps"] = sel("ref_log_prob")
    flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
    answer = hook().grpo_lm_head_loss(hidden=flat, weight=weight, labels=labels, advantages=sel("advantages"),
                                      mask=weights[mask], options={**per_token, **options})
    if answer is None:
        call.declined = "a grpo_lm_head_loss plugin deferred"
        return None
    loss, metrics = answer
    shape = tuple(hidden.shape[:-1])
    log_probs = torch.zeros(shape, dtype=torch.float32, device=device)
    log_probs.view(-1)[index] = metrics["logps"].float()
    log_probs = _anchored(log_probs, loss, positions)
    entropy = torch.zeros(shape, dtype=torch.float32, device=device)
    if call.calculate_entropy:
        entropy.view(-1)[index] = metrics["entropy"].float()
    call.loss = loss
    call.used = {name: (None if value is None else value.detach()) for name, value in inputs.items()}
    logps = torch.zeros(mask.shape, dtype=torch.float32, device=device)
    logps[mask] = metrics["logps"].float()
    call.logps = logps
    return log_probs, entropy


def _anchored(log_probs: Any, loss: Any, positions: Any) -> Any:
    """``log_probs`` (same values) connected to the tiled loss through one position no loss reads.

    The model's (FSDP-wrapped) forward must return a tensor the backward flows through:
    FSDP2 registers the root module's pre-backward hook (unshard its parameters, queue the
    gradient reduce-scatter) on the forward's outputs, and the tiled loss's gradient reaches
    the backbone through the hidden state, not through those outputs. So the returned
    log-probs get ``+ 0 * (loss - loss.detach())`` everywhere and ``+ (loss - loss.detach())``
    (exactly 0) at one position that predicts no response token (the last token of a row:
    verl's response slices end one before it): its gradient there is exactly 0, so the
    tiled loss still receives exactly its own gradient, through the policy loss.
    """
    import torch

    flat = log_probs.view(-1)
    free = torch.ones(flat.numel(), dtype=torch.bool, device=flat.device)
    free[positions.reshape(-1).to(flat.device).clamp(0, flat.numel() - 1)] = False
    candidates = torch.nonzero(free).flatten()
    if candidates.numel() == 0:  # cannot happen: a row's last token predicts no response token
        raise RuntimeError("grpo_patches: tiled_loss found no free position for its gradient anchor")
    bump = torch.zeros_like(flat)
    bump[candidates[-1]] = 1.0
    return (flat + bump * (loss - loss.detach())).view(log_probs.shape)
