"""The zero-advantage filter in v0.5.0's DTensor policy worker v2.

v0.5.0's ``train()`` is one inline loop: it computes ``global_valid_seqs`` / ``global_valid_toks``
from the global batch, then takes micro-batches from ``batch.make_microbatch_iterator(mbs)``
(or ``make_microbatch_iterator_with_dynamic_shapes()``) and counts them from the unfiltered
batch (``iterator_len``), so every micro-batch it gets is treated as real: DP alignment uses
zero-weight micro-batches (:mod:`.zero_advantage`).

The worker class itself is ``@ray.remote``-decorated in v0.5.0, and Ray ships such a class to
the actor process *by value* (cloudpickle: the module attribute is the actor handle, not the
class), so a patch on the class — made in any process — never reaches the actor (measured
with a real Ray cluster). ``BatchedDataDict`` is shipped by reference, so its methods are
wrapped instead, and they act only when called directly from the v2 worker's ``train``
(:func:`.frames.train_frame`), never for ``get_logprobs``, ``score`` or another worker. That
frame also gives the worker, the loss object and the number of global batches. Each global
batch is a :class:`~.state.TrainCall` of its own (no other per-call hook point; the filter's
counters ride on the loss metrics). ``dropped_rows_metrics=True`` and sequence packing are not
supported here.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import bind

from . import FRAMEWORK, frames
from .state import COUNTERS, TrainCall, begin_train
from .trim import multiple_of
from .zero_advantage import decide, plan


def _filtered(wrapped: Callable[..., Any], batch: Any, args: tuple, kwargs: dict, dynamic: bool) -> Any:
    frame = frames.train_frame()
    if frame is None:
        return wrapped(*args, **kwargs)
    worker, loss_fn = frame.worker, frame.loss_fn
    train = TrainCall(worker=worker, loss_fn=loss_fn, frame=frame.key, counters_in_loss=True)
    begin_train(train)
    on = FRAMEWORK.on("zero_advantage_filter") and not frame.eval_mode and type(loss_fn).__name__ == "ClippedPGLossFn"
    if on and FRAMEWORK.on("dropped_rows_metrics"):
        FRAMEWORK.refuse_or_note("zero_advantage_filter", "dropped_rows_metrics=True needs NeMo-RL >= 0.6.0; "
                                 "pass dropped_rows_metrics=False")
        on = False
    train.filter_on = on and decide(loss_fn, worker, batch, packing=bool(getattr(worker, "enable_seq_packing", False)))
    if not train.filter_on:
        return wrapped(*args, **kwargs)
    mbs = None if dynamic else int(bind(wrapped, args, kwargs)["microbatch_size"])
    multiple = multiple_of(getattr(worker, "cfg", None) or {}, dynamic)
    layout, own = plan(batch, loss_fn, mbs or 1, dynamic, worker.dp_mesh.get_group(), False, multiple=multiple)
    own.global_batches = frame.global_batches
    train.current = own
    FRAMEWORK.report_savings(**{name: getattr(own, name) for name in COUNTERS if getattr(own, name)})
    return iter(layout.microbatches)


def make_microbatch_iterator(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``BatchedDataDict.make_microbatch_iterator(microbatch_size)``."""
    return _filtered(wrapped, instance, args, kwargs, False)


def make_microbatch_iterator_with_dynamic_shapes(wrapped: Callable[..., Any], instance: Any, args: tuple,
                                                 kwargs: dict) -> Any:
    """``BatchedDataDict.make_microbatch_iterator_with_dynamic_shapes()``."""
    return _filtered(wrapped, instance, args, kwargs, True)
