"""One decision per ``train()`` call of the DTensor policy worker v2 (v0.6.0+), made inside it.

The worker runs as a Ray actor, and Ray builds the actor's class when
``dtensor_policy_worker_v2`` is imported (``@ray.remote``): it copies every method into the
class it ships to the actor by value (each wrapped for tracing), so a wrapper put on
``DTensorPolicyWorkerV2Impl.train`` afterwards never runs there. What the shipped ``train``
does look up again in the actor are the module names it calls (pickled by reference, hence
``pickle_by_reference`` on this adapter's module-level worker records). Two of them bracket
each call:

* ``process_global_batch`` (first of every global batch): at a call's first global batch a
  :class:`~.state.TrainCall` is made from ``train``'s own arguments (its frame: ``self``,
  ``loss_fn``, ``eval_mode``), and the zero-advantage filter and the tiled loss are decided for
  the call, from the loss object it really received (NeMo-RL pickles it from the driver each
  time): ``"auto"`` switches either off when it cannot reproduce NeMo-RL exactly (the reason
  goes to this worker's ``status()``), ``True`` raises before anything trains;
* ``aggregate_training_statistics`` (the call's last step): the filter's counters and verify
  mode's figures (:mod:`.verify`) go into the metrics ``train`` returns, and the call ends.

The other worker wrappers find the call through :func:`~.state.active_train` (only while that
``train`` frame runs: ``get_logprobs`` and the like always see every row). Evaluation calls
(``eval_mode=True``) and losses other than ``ClippedPGLossFn`` pass through.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from grpo_patches import api

from . import filter as zero_advantage_filter
from . import tiled, verify
from .metrics import report_filter_counters
from .calls import arguments, worker_train_frame
from .state import ACTIVE_TRAIN, FRAMEWORK, TrainCall, active_train


def _begin(frame: Any, loss_fn: Any, data: Any) -> TrainCall:
    local = frame.f_locals
    worker = local.get("self")
    train = TrainCall(worker=worker, loss_fn=loss_fn, frame_id=id(frame), code=frame.f_code)
    options = api.active_options(FRAMEWORK)
    policy_gradient = type(loss_fn).__name__ == "ClippedPGLossFn" and "advantages" in data
    if options is not None and not local.get("eval_mode", False) and policy_gradient:
        if options.zero_advantage_filter is not False:
            packing = bool(getattr(worker, "enable_seq_packing", False))
            train.filter_on = zero_advantage_filter.decide(loss_fn, worker, data, packing)
        if options.tiled_loss is not False:
            train.tiled_on = tiled.decide(loss_fn, worker)
    return train


def process_global_batch_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``process_global_batch(data, loss_fn, dp_group, *, batch_idx, batch_size)``, as the worker module names it."""
    start_call(worker_train_frame(sys._getframe(1)), wrapped, args, kwargs, _begin)
    return wrapped(*args, **kwargs)


def start_call(frame: Any, wrapped: Callable[..., Any], args: tuple, kwargs: dict,
               begin: Callable[[Any, Any, Any], TrainCall]) -> None:
    """At ``process_global_batch`` called from a worker's train ``frame`` (``None``: from elsewhere):
    a new train call (``begin(frame, loss_fn, data)``) starts at a new frame or its first global batch."""
    if frame is None:
        return
    call = arguments(wrapped, args, kwargs)
    current = ACTIVE_TRAIN.get()
    if current is None or current.frame_id != id(frame) or int(call["batch_idx"]) == 0:
        ACTIVE_TRAIN.set(begin(frame, call["loss_fn"], call["data"]))


def aggregate_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``aggregate_training_statistics(...)``, as the worker module names it: the end of a train call."""
    result = wrapped(*args, **kwargs)
    train = active_train()
    if train is not None:
        if train.filter_on or train.rows_dropped:
            report_filter_counters(train, result)
        verify.report(train, result)
        ACTIVE_TRAIN.set(None)
    return result
