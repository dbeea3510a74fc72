"""Hook specifications of grpo_patches (pluggy project name ``"grpo_patches"``).

Every optimization is a hook: adapters read the framework's state, call the hook and apply
the answer; the built-in implementations (:mod:`grpo_patches.defaults`) are registered
``trylast`` so a user's plugin can override any decision. Decisions are ``firstresult``:
the first implementation that returns something other than ``None`` wins, so a plugin may
also return ``None`` to defer to the default.

Plugins are modules or objects with ``@grpo_patches.hookimpl`` functions, registered with
``grpo_patches.plugin_manager().register(obj)`` or through the ``grpo_patches`` entry-point
group (autoloading is disabled by ``GRPO_PATCHES_DISABLE_PLUGIN_AUTOLOAD=1``).

A decision's answer is checked against the contract its docstring states where the adapter
receives it (:mod:`grpo_patches.hook_contracts`): a broken one stops the run with one
:class:`~grpo_patches.errors.HookContractError` naming the plugin and the rule, before it acts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import pluggy

PROJECT_NAME = "grpo_patches"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

if TYPE_CHECKING:  # pragma: no cover - typing only; the core never imports torch eagerly
    import torch

    from grpo_patches.reference_pass import ReferencePassDecision
    from grpo_patches.zero_advantage import ZeroAdvantageFilter


@hookspec(firstresult=True)
def grpo_recompute_old_logps(
    framework: str,
    consumptions_left: int,
    window_steps_left: int,
    needed_elsewhere: bool,
) -> bool | None:
    """Decide whether a freshly generated rollout needs old-policy log-probs.

    The one owner of the old-logprob pass: every adapter asks this hook, once per rollout
    (or rollout batch), at generation time, and applies its answer.

    :param framework: the adapter calling (``"trl"``, ``"verl"``, ``"nemo_rl"``).
    :param consumptions_left: how many micro-steps, counting the current one, will consume
        this rollout before it is discarded (already capped at the micro-steps left in
        training).
    :param window_steps_left: how many micro-steps, counting the current one, are really
        left in the current gradient-accumulation window: the optimizer steps right after
        the last of them. Shorter than ``gradient_accumulation_steps`` at an epoch end or
        after a resume that restarted the framework's counters.
    :param needed_elsewhere: something besides the policy ratio consumes the trainer's old
        log-probs whatever the schedule: an importance-sampling correction against the
        generator (e.g. vLLM), a log-prob mismatch threshold, a logged metric built on them.
    :return: ``True`` to compute old log-probs, ``False`` when every consumption sees the
        weights that generated the rollout (the framework may then use the detached current
        log-probs as old ones, exactly), ``None`` to defer.
    """


@hookspec(firstresult=True)
def grpo_skip_reference_pass(
    framework: str,
    kl_coefficients: Mapping[str, float],
    kl_metrics_requested: bool,
) -> "ReferencePassDecision | None":
    """Decide whether the reference-policy log-prob pass (and model) can be skipped.

    The one owner of the reference pass. Asked when the trainer is set up (whether to build
    the reference model at all) and per step where the framework decides per step.

    :param kl_coefficients: every coefficient that would consume reference log-probs,
        named as the framework names them (``{"beta": 0.0}``,
        ``{"kl_loss_coef": 0.0, "kl_ctrl.kl_coef": 0.0}``).
    :param kl_metrics_requested: the user asked for KL to be logged even though no loss
        term uses it; the reference pass must then run.
    :return: a :class:`~grpo_patches.reference_pass.ReferencePassDecision` with a
        human-readable reason, or ``None`` to defer.
    """


@hookspec(firstresult=True)
def grpo_filter_zero_advantage(
    advantages: "torch.Tensor",
    mask: "torch.Tensor",
    denominator: str,
    group: Any,
) -> "ZeroAdvantageFilter | None":
    """Choose the rows of one micro-batch to keep, with per-row loss weights.

    A row is dropped only when every advantage of its unmasked tokens is exactly ``0.0``; at
    least one row is kept; ``keep`` is ascending without repeats; one finite weight ``>= 0`` per
    kept row (checked: :mod:`grpo_patches.hook_contracts`).
    The weights are chosen so that computing the framework's own aggregation on the kept
    rows, with each kept row's per-token loss multiplied by its weight, gives the loss and
    gradient of the full micro-batch: every kept row keeps its original denominator.

    :param advantages: ``[B]`` (per row) or ``[B, T]`` (per token) advantages.
    :param mask: ``[B, T]`` loss mask (``1`` for response tokens that enter the loss).
    :param denominator: what the framework's loss divides by, one of
        :data:`grpo_patches.zero_advantage.DENOMINATORS`: ``"tokens"`` (the micro-batch's
        unmasked tokens), ``"rows"`` (the micro-batch's rows) or ``"fixed"`` (a number that
        does not depend on which rows are present).
    :param group: the data-parallel process group whose ranks must make identical decisions
        (``None`` for the default group when ``torch.distributed`` is initialised).
    :return: a :class:`~grpo_patches.zero_advantage.ZeroAdvantageFilter`, or ``None``.
    """


@hookspec(firstresult=True)
def grpo_lm_head_loss(
    hidden: "torch.Tensor",
    weight: "torch.Tensor",
    labels: "torch.Tensor",
    advantages: "torch.Tensor",
    mask: "torch.Tensor",
    options: Mapping[str, Any],
) -> "tuple[torch.Tensor, dict[str, torch.Tensor]] | None":
    """Compute the GRPO policy loss from hidden states and the lm-head weight.

    The default computes it tile by tile (:func:`grpo_patches.tiled_grpo_loss`) without
    materializing ``[tokens, vocab]`` logits. ``options`` are that function's keyword
    arguments (``old_logps``, ``ref_logps``, ``bias``, ``temperature``, ``objective``,
    ``aggregation``, ...).

    :return: ``(loss, metrics)``, or ``None`` to defer.
    """


@hookspec(firstresult=True)
def grpo_lm_head_token_stats(
    hidden: "torch.Tensor",
    weight: "torch.Tensor",
    labels: "torch.Tensor",
    mask: "torch.Tensor | None",
    options: Mapping[str, Any],
) -> "tuple[torch.Tensor, torch.Tensor] | None":
    """Per-token log-probs and entropies from hidden states and the lm-head weight, without gradients.

    What an adapter needs before the loss when a token's weight depends on the policy's own
    distribution (TRL's high-entropy mask: pass the mask to ``grpo_lm_head_loss`` as
    ``policy_token_mask``). The default is :func:`grpo_patches.tiled_loss.tiled_token_stats`;
    ``options`` are its keyword arguments (``bias``, ``temperature``, ``logit_scale``,
    ``logit_softcap``, ``tile_size``).

    :return: ``(logps, entropy)`` shaped like ``labels`` (0 where masked), or ``None`` to defer.
    """


@hookspec
def grpo_report_savings(framework: str, savings: Mapping[str, float]) -> None:
    """Observe work saved (``{"old_logprob_passes_skipped": 1, ...}``, added to totals).

    Every implementation is called. The default adds the counts to the totals shown by
    :func:`grpo_patches.status`; adapters forward them into the framework's own metrics.
    """
