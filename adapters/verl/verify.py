"""Verify mode for verl (``verify_every``, :mod:`grpo_patches.verify`): what both code lines share.

verl's update hides its micro-batch loop (legacy ``update_policy``; the engine's
``forward_backward_batch``), and the zero-advantage filter changes which micro-batches there
are, so verl is verified one optimizer step at a time: on a verify step the mini-batch's
gradient is computed patched and, from the same random state, weights and inputs, by verl
with every record passing through (``FRAMEWORK.unpatched()``); each lands in ``.grad`` through verl's own
backward (loss scaling, FSDP's reduce-scatter), is taken out, and the chosen one is put back,
so ``.grad`` ends as the chosen computation alone leaves it. A skipped old-logprob pass really
runs (forward only, eval mode, before the update) and is compared with the log-probs the loss
used; the skipped reference pass is checked as the loss with and without its KL term. Each
line's step: :mod:`.verify_engine` (0.8+: per ``forward_backward_batch``, one optimizer step),
:mod:`.verify_legacy` (``DataParallelPPOActor``, 0.6.1-0.7.x: the whole ``update_policy`` run
both ways, compared before each of its optimizer steps). What each run watches is
``UpdateCall.verify`` (:class:`~.state.VerifyCapture`). The Megatron actors: :mod:`.verify_megatron`.

**How a switch-off reaches the trainer.** ``verify_action="disable"`` switches options off in
the worker process that found the difference (every data-parallel rank agrees: one
all-reduce per figure). The trainer (the driver, or verl's ``TaskRunner`` actor under Ray) is
another process and still skips the old-logprob pass; so the worker adds
``grpo_patches/verify/switched_off/<option>`` (1.0) to the metrics of that update, which verl
carries back to the trainer with its own, and the trainer's ``_update_actor`` wrapper
(:mod:`.skip_guarantee`) switches the same options off there (:func:`adopt_switch_offs`): from
the next step on the trainer runs the pass again, exactly as unpatched verl.
"""

from __future__ import annotations

from typing import Any, Iterable, MutableMapping, Sequence

from grpo_patches import api
from grpo_patches import verify as core

from . import FRAMEWORK, state

#: The metric a worker adds for each option verification switched off (the trainer adopts it).
SWITCHED_OFF = core.METRIC_PREFIX + "switched_off/"


def next_step(owner: Any) -> int:
    """The 0-based optimizer step of ``owner``'s next update (and count it)."""
    own = state.of(owner)
    step = own.optimizer_steps
    own.optimizer_steps += 1
    return step


def optimizations_on(owner: Any) -> list[str]:
    """The grad-changing optimizations decided on for ``owner`` (decided from its config, the
    same on every rank: each rank then makes the same checks)."""
    own = state.of(owner)
    return [name for name, on in (("zero_advantage_filter", own.filter_mode is not None),
                                  ("tiled_loss", own.tiled)) if on]


def forget_decisions(owner: Any) -> None:
    """After a switch-off: ``owner``'s filter and tiled-loss decisions are taken again (now off)."""
    own = state.of(owner)
    own.decided = own.tiled_decided = False
    own.filter_mode, own.tiled = None, False


def grads(params: Sequence[Any]) -> list:
    """The ``.grad`` of each parameter (the tensors themselves)."""
    return [p.grad for p in params]


def set_grads(params: Sequence[Any], values: Sequence[Any]) -> None:
    for p, g in zip(params, values):
        p.grad = g


def copies(values: Iterable[Any]) -> list:
    return [None if v is None else v.detach().clone() for v in values]


def mark_switched_off(metrics: MutableMapping[str, Any], options: Iterable[str], as_list: bool = True) -> None:
    """Tell the trainer which options the worker's verification switched off (module docstring)."""
    for option in options:
        metrics[SWITCHED_OFF + option] = [1.0] if as_list else 1.0


def adopt_switch_offs(metrics: MutableMapping[str, Any] | None) -> list[str]:
    """In the trainer: switch off every option an update's metrics say verification switched off."""
    adopted = []
    for name in list(metrics or {}):
        if SWITCHED_OFF not in name:
            continue
        option = name.split(SWITCHED_OFF, 1)[1]
        if option in api.OPTIMIZATIONS:
            FRAMEWORK.switch_off(option, "switched off by verification in the actor's workers (their "
                           f"{core.METRIC_PREFIX}* metrics say why); the trainer stops skipping too")
            adopted.append(option)
    return adopted


def add_figures(metrics: MutableMapping[str, Any], figures: dict[str, float], as_list: bool = True) -> None:
    for name, value in figures.items():
        metrics[name] = [value] if as_list else value
