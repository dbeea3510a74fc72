"""``DTensorPolicyWorkerV2Impl.train`` (v0.6.0+): one decision per train call, in the worker.

The loss object arrives with every call (NeMo-RL pickles it from the driver), so the
zero-advantage filter and the tiled loss are decided here, from what this call will really
compute: ``"auto"`` switches either off for this call when it cannot reproduce NeMo-RL
exactly (the reason goes to this worker's ``status()``); ``True`` raises. Evaluation calls
(``eval_mode=True``) have no backward to save and pass through.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches import api

from . import filter as zero_advantage_filter
from . import filter_rows, tiled
from .calls import arguments
from .state import ACTIVE_TRAIN, FRAMEWORK, TrainCall


def train_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``train(data, loss_fn, eval_mode=False, gbs=None, mbs=None, ...)``."""
    options = api.active_options(FRAMEWORK)
    call = arguments(wrapped, args, kwargs)
    train = TrainCall(worker=instance, loss_fn=call["loss_fn"])
    policy_gradient = type(train.loss_fn).__name__ == "ClippedPGLossFn" and "advantages" in call["data"]
    if options is not None and not call["eval_mode"] and policy_gradient:
        if options.zero_advantage_filter is not False:
            packing = bool(getattr(instance, "enable_seq_packing", False))
            train.filter_on = filter_rows.decide(train.loss_fn, instance, call["data"], packing)
        if options.tiled_loss is not False:
            train.tiled_on = tiled.decide(train.loss_fn, instance)
    token = ACTIVE_TRAIN.set(train)
    try:
        result = wrapped(*args, **kwargs)
    finally:
        ACTIVE_TRAIN.reset(token)
    if train.filter_on:
        zero_advantage_filter.report(train, result)
    return result
