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

from . import metrics, state
from .loss_rows import MULTIMODAL_KEYS, loss_call, loss_mask
from .loss_types import denominator, gradient_terms


def decide(trainer: Any) -> bool:
    """Whether the filter runs for ``trainer`` (decided once, at its first loss call).

    :raises IncompatibleOptionsError: ``zero_advantage_filter=True`` with a config that
        gives zero-advantage rows a gradient (names the setting and the fix).
    :raises OptionError: ``zero_advantage_filter=True`` with a ``loss_type`` it cannot handle.
    """
    own = state.of(trainer)
    if own.filter_on is not None:
        return own.filter_on
    from grpo_patches.zero_advantage import require_filter_compatible

    loss_type = getattr(trainer, "loss_type", "grpo")
    try:
        require_filter_compatible(gradient_terms(trainer))
        denominator(loss_type)
    except (IncompatibleOptionsError, OptionError) as exc:
        if api.active_options("trl") is None or api.strict("trl", "zero_advantage_filter"):
            raise type(exc)(f"zero_advantage_filter=True: {exc}") from None
        api.note("trl", "zero_advantage_filter", f"off: {exc}")
        own.filter_on = False
        return False
    api.note("trl", "zero_advantage_filter", f"on (loss_type={loss_type!r})")
    own.filter_on = True
    return True


def compute_loss_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``GRPOTrainer._compute_loss(model, inputs)``."""
    inputs = kwargs["inputs"] if "inputs" in kwargs else args[1]
    if instance is None or not instance.model.training or not decide(instance):
        return wrapped(*args, **kwargs)
    if any(inputs.get(key) is not None for key in MULTIMODAL_KEYS):
        return wrapped(*args, **kwargs)  # per-image tensors are not row-indexed: keep every row

    from grpo_patches.plugins import hook

    plan = hook().grpo_filter_zero_advantage(
        advantages=inputs["advantages"],
        mask=loss_mask(inputs),
        denominator=denominator(instance.loss_type),
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
