"""A policy worker's ``train()`` call (v0.6.0+, DTensor and Megatron workers): where it begins and ends.

The worker runs as a Ray actor, and Ray ships its ``train`` to the actor by value, so no wrapper
encloses the call (:mod:`.frames` says why). What ``train`` does look up again in the actor are
the module names it calls (hence ``pickle_by_reference`` on these records); two of them bracket
each call, whatever the options:

* ``process_global_batch`` (first of every global batch): at a call's first global batch a
  :class:`~.state.TrainCall` is made from ``train``'s own arguments (its frame: ``self``,
  ``eval_mode``; :mod:`.frames`) and entered (:func:`~.state.begin_train`), and the
  zero-advantage filter and the tiled loss are decided for the call, from the loss object it
  really received (NeMo-RL pickles it from the driver each time): ``"auto"`` switches either off
  when it cannot reproduce NeMo-RL exactly (the reason goes to this worker's ``status()``),
  ``True`` raises before anything trains;
* ``aggregate_training_statistics`` (the call's last step): the filter's counters and verify
  mode's figures (:mod:`.verify_results`) go into the metrics ``train`` returns, and the call ends.

The other worker wrappers find the call through :func:`~.state.current_train` (only while that
``train`` frame runs: ``get_logprobs`` and the like always see every row). Evaluation calls
(``eval_mode=True``) and losses other than ``ClippedPGLossFn`` keep every option off. The Megatron
worker (``_megatron``) adds the settings its filter does not cover (:mod:`.zero_advantage_megatron`)
and has no tiled loss or verify mode.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import bind

from . import FRAMEWORK, frames, tiled, zero_advantage, zero_advantage_megatron
from .calls import setting
from .metrics import report_filter_counters
from .state import TrainCall, begin_train, current_train, end_train
from .verify_results import report_figures


def _policy_gradient(frame: frames.TrainFrame, loss_fn: Any, data: Any) -> bool:
    return not frame.eval_mode and type(loss_fn).__name__ == "ClippedPGLossFn" and "advantages" in data


def _begin_dtensor(frame: frames.TrainFrame, loss_fn: Any, data: Any) -> TrainCall:
    worker = frame.worker
    train = TrainCall(worker=worker, loss_fn=loss_fn, frame=frame.key)
    if FRAMEWORK.enabled and _policy_gradient(frame, loss_fn, data):
        if FRAMEWORK.on("zero_advantage_filter"):
            packing = bool(getattr(worker, "enable_seq_packing", False))
            train.filter_on = zero_advantage.decide(loss_fn, worker, data, packing)
        if FRAMEWORK.on("tiled_loss"):
            train.tiled_on = tiled.decide(loss_fn, worker)
    return train


def _begin_megatron(frame: frames.TrainFrame, loss_fn: Any, data: Any) -> TrainCall:
    worker = frame.worker
    train = TrainCall(worker=worker, loss_fn=loss_fn, frame=frame.key)
    if not (FRAMEWORK.on("zero_advantage_filter") and _policy_gradient(frame, loss_fn, data)):
        return train
    cfg = getattr(worker, "cfg", None) or {}
    found = zero_advantage_megatron.problems(cfg, getattr(getattr(worker, "model", None), "config", None),
                                             FRAMEWORK.on("dropped_rows_metrics"))
    if found:
        FRAMEWORK.refuse_or_note("zero_advantage_filter", found)
        return train
    train.filter_on = zero_advantage.decide(loss_fn, worker, data,
                                            packing=bool(setting(cfg, "sequence_packing.enabled", False)))
    return train


def _start(worker_file: str, begin: Callable[[frames.TrainFrame, Any, Any], TrainCall], wrapped: Callable[..., Any],
           args: tuple, kwargs: dict) -> None:
    """At ``process_global_batch`` called from a worker's ``train`` (in ``worker_file``): a new train
    call (``begin(frame, loss_fn, data)``) begins at a new frame or at its first global batch."""
    frame = frames.train_frame(worker_file)
    if frame is None:
        return
    call = bind(wrapped, args, kwargs)
    current = current_train()
    if current is None or current.frame != frame.key or int(call["batch_idx"]) == 0:
        begin_train(begin(frame, call["loss_fn"], call["data"]))


def _end(returned: Any) -> None:
    """At ``aggregate_training_statistics``: the call's counters and verify figures into what ``train``
    returns (``returned["all_mb_metrics"]``), and the call left."""
    train = current_train()
    if train is None:
        return
    if train.filter_on or train.rows_dropped:
        report_filter_counters(train, returned)
    report_figures(train, returned)
    end_train(train)


def process_global_batch(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``process_global_batch(data, loss_fn, dp_group, *, batch_idx, batch_size)`` of the DTensor worker module."""
    _start(frames.DTENSOR_WORKER_FILE, _begin_dtensor, wrapped, args, kwargs)
    return wrapped(*args, **kwargs)


def aggregate_training_statistics(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``aggregate_training_statistics(...)`` -> the metrics dict ``train`` returns: the end of a train call."""
    result = wrapped(*args, **kwargs)
    _end(result)
    return result


def process_global_batch_megatron(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``process_global_batch(data, loss_fn, dp_group, *, batch_idx, batch_size)`` of the Megatron worker module."""
    _start(frames.MEGATRON_WORKER_FILE, _begin_megatron, wrapped, args, kwargs)
    return wrapped(*args, **kwargs)


def aggregate_training_statistics_megatron(wrapped: Callable[..., Any], instance: Any, args: tuple,
                                           kwargs: dict) -> Any:
    """``aggregate_training_statistics(...)`` -> ``(mb_metrics, global_loss)``, as the Megatron worker
    module names it: the end of a train call; the filter's counters go into ``mb_metrics``."""
    result = wrapped(*args, **kwargs)
    _end({"all_mb_metrics": result[0]})
    return result
