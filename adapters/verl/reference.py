"""The reference pass and model at KL coefficient 0 (option ``logprob_skip``).

verl builds a reference model and runs its log-prob pass whenever ``actor.use_kl_loss`` or
``algorithm.use_kl_in_reward`` is set, whatever the coefficient
(``verl/trainer/ppo/utils.py::need_reference_policy``; imported by name into ``main_ppo``,
``ray_trainer`` and, in 0.9, ``main_ppo_v0`` and ``v1/trainer_base``, so every binding is
wrapped). When the ``grpo_skip_reference_pass`` hook says no coefficient can be non-zero, it
answers False: verl then creates no reference worker (no second model in memory) and skips
the pass by its own ``if self.use_reference_policy``. No placeholder stands in for the
reference log-probs:

* legacy actor (``update_policy``) and engine (``forward_backward_batch``): verl's loss runs
  with ``use_kl_loss=False`` on a copy of the actor config (verl would add ``kl_loss * 0.0``:
  ``x + 0 * kl == x``, so the gradients are bitwise the same), so it never asks for
  ``ref_log_prob`` and logs no ``actor/kl_loss``/``kl_loss``/``kl_coef`` metric;
* ``apply_kl_penalty`` (in-reward KL, fixed controller at 0): the penalty is computed against
  the old log-probs themselves (a KL of exactly 0, times 0); ``actor/reward_kl_penalty`` is not
  logged. In-reward KL always keeps the old-logprob pass (:mod:`.old_logprobs`); should a skipped
  pass's placeholder ever get here, it raises (:class:`~.placeholders.PlaceholderError`).

verl's Megatron workers (the engine's ``forward_backward_batch``, the legacy worker's ``update_actor``):
:mod:`.reference_megatron`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from grpo_patches.call_args import bind

from . import FRAMEWORK
from . import metrics as verl_metrics
from .calls_engine import actor_config_of
from .config_value import config_value
from .placeholders import FIX, PlaceholderError, present

#: Legacy ``update_policy`` / engine ``ppo_loss`` metrics of the KL loss (not logged at coefficient 0).
KL_METRICS = ("actor/kl_loss", "actor/kl_coef", "kl_loss", "kl_coef")


def kl_coefficients(config: Any) -> dict[str, float] | None:
    """Every coefficient that consumes reference log-probs, or ``None`` when one can change
    during training (an adaptive in-reward KL controller)."""
    coefficients: dict[str, float] = {}
    if config_value(config, "actor_rollout_ref.actor.use_kl_loss", False):
        coefficient = config_value(config, "actor_rollout_ref.actor.kl_loss_coef", 0.0)
        coefficients["actor_rollout_ref.actor.kl_loss_coef"] = float(coefficient)
    if config_value(config, "algorithm.use_kl_in_reward", False):
        if config_value(config, "algorithm.kl_ctrl.type", "fixed") != "fixed":
            return None
        coefficients["algorithm.kl_ctrl.kl_coef"] = float(config_value(config, "algorithm.kl_ctrl.kl_coef", 0.0))
    return coefficients


def skip_reference(config: Any) -> bool:
    """The ``grpo_skip_reference_pass`` hook's answer for a trainer config (noted in status)."""
    if not FRAMEWORK.on("logprob_skip"):
        return False
    coefficients = kl_coefficients(config)
    if coefficients is None:
        FRAMEWORK.note("reference_pass", "runs: algorithm.kl_ctrl.type is adaptive (the coefficient changes)")
        return False
    if not coefficients:
        return False  # verl needs no reference model anyway
    from grpo_patches.plugins import hook

    decision = hook().grpo_skip_reference_pass(framework=FRAMEWORK.name, kl_coefficients=coefficients,
                                               kl_metrics_requested=False)
    if decision is None:
        return False
    FRAMEWORK.note("reference_pass", f"{'skipped, no reference model' if decision.skip else 'runs'}: {decision.reason}")
    return decision.skip


def need_reference_policy(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``need_reference_policy(config)`` (0.7+; every module's binding)."""
    needed = wrapped(*args, **kwargs)
    config = bind(wrapped, args, kwargs)["config"]
    if needed and config is not None and skip_reference(config):
        return False
    return needed


def add_ref_policy_worker(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of 0.6's ``TaskRunner.add_ref_policy_worker(config, cls)``: 0.6 decides the
    reference model from the role mapping this fills, so the role is taken out again."""
    out = wrapped(*args, **kwargs)
    config = bind(wrapped, args, kwargs)["config"]
    if instance is not None and config is not None and skip_reference(config):
        from verl.trainer.ppo.utils import Role

        instance.role_worker_mapping.pop(Role.RefPolicy, None)
        instance.mapping.pop(Role.RefPolicy, None)
    return out


def zero_coefficient(config: Any) -> bool:
    """Whether the actor config asks for a KL loss at coefficient 0 (the reference pass skipped)."""
    return bool(getattr(config, "use_kl_loss", False)) and float(getattr(config, "kl_loss_coef", 0.0)) == 0.0


def without_kl_loss(config: Any) -> Any:
    """A shallow copy of an actor config with ``use_kl_loss=False`` (verl's configs are frozen dataclasses)."""
    import copy
    import dataclasses

    clone = copy.copy(config)
    if dataclasses.is_dataclass(clone):
        object.__setattr__(clone, "use_kl_loss", False)
    else:  # an OmegaConf DictConfig
        from omegaconf import open_dict

        with open_dict(clone):
            clone.use_kl_loss = False
    return clone


def legacy_update_without_kl_loss(wrapped: Callable[..., Any], actor: Any, args: tuple, kwargs: dict,
                                  metrics: Callable[[Any], dict]) -> Any:
    """A legacy update (``actor``'s, whose ``config`` verl reads during it) without reference log-probs at
    KL coefficient 0: run with the KL loss off, its KL metrics (``metrics(output)``) removed, the saving reported."""
    data = bind(wrapped, args, kwargs)["data"] if actor is not None else None
    if data is None or not zero_coefficient(actor.config) or "ref_log_prob" in data.batch.keys():
        return wrapped(*args, **kwargs)
    config = actor.config
    actor.config = without_kl_loss(config)  # verl reads self.config.use_kl_loss inside the update
    try:
        output = wrapped(*args, **kwargs)
    finally:
        actor.config = config
    logged = metrics(output)
    for name in KL_METRICS:
        logged.pop(name, None)
    verl_metrics.report(logged, reference_passes_skipped=1)
    return output


def update_policy(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the legacy ``DataParallelPPOActor.update_policy(data) -> metrics``: without reference
    log-probs (KL coefficient 0), the update runs with the KL loss off."""
    return legacy_update_without_kl_loss(wrapped, instance, args, kwargs, lambda metrics: metrics)


def forward_backward_batch(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the engine's ``FSDPEngine.forward_backward_batch``: without reference
    log-probs (KL coefficient 0), verl's ``ppo_loss`` runs with the KL loss off."""
    call = bind(wrapped, args, kwargs)
    data, loss_function, forward_only = call["data"], call["loss_function"], call["forward_only"]
    config = actor_config_of(loss_function)
    if forward_only or config is None or not zero_coefficient(config) or "ref_log_prob" in data.keys() \
            or not isinstance(loss_function, functools.partial):
        return wrapped(*args, **kwargs)
    loss = functools.partial(loss_function.func, *loss_function.args,
                             **{**loss_function.keywords, "config": without_kl_loss(config)})
    from verl.utils import tensordict_utils as tu

    last = bool(tu.get_non_tensor_data(data=data, key="update_lr_scheduler", default=True))
    output = wrapped(data, loss, forward_only)
    for name in KL_METRICS:
        output["metrics"].pop(name, None)
    if last:  # once per update (verl's last mini-batch of it), as the pass would have run once
        verl_metrics.report(None, reference_passes_skipped=1)
        output["metrics"][verl_metrics.PREFIX + "reference_passes_skipped"] = [1.0]
    return output


def apply_kl_penalty(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``apply_kl_penalty(data, kl_ctrl, ...)``: in-reward KL at a fixed 0."""
    call = bind(wrapped, args, kwargs)
    data, kl_ctrl = call["data"], call["kl_ctrl"]
    if "ref_log_prob" in data.batch.keys() or float(kl_ctrl.value) != 0.0:
        return wrapped(*args, **kwargs)
    if present(data.batch["old_log_probs"]):
        raise PlaceholderError("grpo_patches: the in-reward KL penalty would read a skipped old-logprob pass's "
                               f"placeholder (algorithm.use_kl_in_reward should have kept the pass); please report "
                               f"this and {FIX}")
    data.batch["ref_log_prob"] = data.batch["old_log_probs"]  # KL exactly 0; times beta == 0 anyway
    try:
        data, kl_metrics = wrapped(*args, **kwargs)
    finally:
        data.batch.pop("ref_log_prob")
    kl_metrics.pop("actor/reward_kl_penalty", None)  # a KL against the old log-probs themselves
    return data, kl_metrics
