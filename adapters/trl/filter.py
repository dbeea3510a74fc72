"""Zero-advantage filter for TRL's GRPOTrainer: skip the backward of rows with advantage 0.

Wraps ``GRPOTrainer._compute_loss``. For each training micro-step it asks the
``grpo_filter_zero_advantage`` hook which rows to keep and hands that plan to the policy
forward (:mod:`.loss_rows`): kept rows run with gradients, dropped rows only in a no-grad
forward, and TRL's own loss code then runs on the whole ``[B, T]`` micro-batch. So:

* every loss type keeps its normaliser without the adapter knowing it (TRL computes it on
  the full micro-batch; the dropped rows' per-token losses are exactly 0 because their
  advantage is exactly 0, and they carry no gradient);
* every metric TRL logs from ``_compute_loss`` (entropy, clip ratios, cispo/vespo metrics)
  is computed by TRL from the true values of every row, in every TRL version;
* the number of micro-steps and optimizer steps never changes; the filter keeps >= 1 row
  and, under data parallelism, every rank runs the same number of forwards.

What is saved is the dropped rows' backward (about 2/3 of their training FLOPs) and their
stored activations; their forward is still run, without autograd, for the metrics.

The filter is exact only when zero-advantage rows have no gradient: ``beta != 0``, an
entropy bonus, an entropy quantile mask or a router aux loss give them one. With
``zero_advantage_filter=True`` such a config raises; with ``"auto"`` (or when enabled via
``"all"``) the filter switches itself off and says why in ``grpo_patches.status()``.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches import api
from grpo_patches.errors import IncompatibleOptionsError, OptionError

from . import metrics
from .loss_rows import MULTIMODAL_KEYS, loss_call, loss_mask

_STATE_ATTR = "_grpo_patches_filter_on"


def incompatible_settings(trainer: Any) -> dict[str, float]:
    """The trainer's settings that decide whether zero-advantage rows have a gradient."""
    settings: dict[str, float] = {"beta": float(getattr(trainer, "beta", 0.0))}
    settings["top_entropy_quantile"] = float(getattr(trainer, "top_entropy_quantile", 1.0))
    settings["entropy_coef"] = float(getattr(trainer, "entropy_coef", 0.0) or 0.0)
    if getattr(trainer, "use_adaptive_entropy", False):
        settings["use_adaptive_entropy"] = 1.0  # the bonus can switch on later in training
    if getattr(trainer, "aux_loss_enabled", False):
        settings["router_aux_loss_coef"] = float(getattr(trainer, "router_aux_loss_coef", 0.0))
    return settings


def decide(trainer: Any) -> bool:
    """Whether the filter runs for ``trainer`` (decided once, at its first loss call).

    :raises IncompatibleOptionsError: ``zero_advantage_filter=True`` with a config that
        gives zero-advantage rows a gradient (names the setting and the fix).
    :raises OptionError: ``zero_advantage_filter=True`` with a ``loss_type`` it cannot handle.
    """
    cached = trainer.__dict__.get(_STATE_ATTR)
    if cached is not None:
        return cached
    from grpo_patches.zero_advantage import aggregation_for, require_filter_compatible

    options = api.active_options("trl")
    value = True if options is None else options.zero_advantage_filter
    strict = value is True and not api.enabled_via_all("trl")
    loss_type = getattr(trainer, "loss_type", "grpo")
    try:
        require_filter_compatible(framework="trl", **incompatible_settings(trainer))
        aggregation_for("trl", loss_type)
    except (IncompatibleOptionsError, OptionError) as exc:
        if strict:
            raise type(exc)(f"zero_advantage_filter=True: {exc}") from None
        api.note("trl", "zero_advantage_filter", f"off: {exc}")
        trainer.__dict__[_STATE_ATTR] = False
        return False
    api.note("trl", "zero_advantage_filter", f"on (loss_type={loss_type!r})")
    trainer.__dict__[_STATE_ATTR] = True
    return True


def compute_loss_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``GRPOTrainer._compute_loss(model, inputs)``."""
    inputs = kwargs["inputs"] if "inputs" in kwargs else args[1]
    if instance is None or not instance.model.training or not decide(instance):
        return wrapped(*args, **kwargs)
    if any(inputs.get(key) is not None for key in MULTIMODAL_KEYS):
        return wrapped(*args, **kwargs)  # per-image tensors are not row-indexed: keep every row

    from grpo_patches.plugins import hook
    from grpo_patches.zero_advantage import aggregation_for

    plan = hook().grpo_filter_zero_advantage(
        advantages=inputs["advantages"],
        mask=loss_mask(inputs),
        aggregation=aggregation_for("trl", instance.loss_type),
        group=None,
    )
    distributed = getattr(instance.accelerator, "num_processes", 1) > 1
    if plan is None or (plan.rows_dropped == 0 and not distributed):
        loss = wrapped(*args, **kwargs)
    else:
        with loss_call(instance) as call:
            call.keep, call.always_split = plan.keep, distributed
            loss = wrapped(*args, **kwargs)
    dropped = 0 if plan is None else plan.rows_dropped
    tokens = 0 if plan is None else plan.tokens_dropped
    metrics.report(instance, rows_dropped=dropped, tokens_dropped=tokens)
    return loss
