"""The zero-advantage filter in v0.5.0's DTensor policy worker v2.

v0.5.0's ``train()`` is one inline loop: it computes ``global_valid_seqs`` / ``global_valid_toks``
from the global batch, then takes micro-batches from ``batch.make_microbatch_iterator(mbs)``
(or ``make_microbatch_iterator_with_dynamic_shapes()``) and counts them from the unfiltered
batch (``iterator_len``), so every micro-batch it gets is treated as real: DP alignment uses
zero-weight micro-batches (:mod:`.filter`).

The worker class itself is ``@ray.remote``-decorated in v0.5.0, and Ray ships such a class to
the actor process *by value* (cloudpickle: the module attribute is the actor handle, not the
class), so a patch on the class — made in any process — never reaches the actor (measured
with a real Ray cluster). ``BatchedDataDict`` is shipped by reference, so its methods are
wrapped instead, and they act only when called directly from the v2 worker's ``train`` (its
frame: function ``train`` in ``dtensor_policy_worker_v2.py``), never for ``get_logprobs``,
``score`` or another worker. That frame also gives the worker, the loss object and the number
of global batches. ``dropped_rows_metrics=True`` and sequence packing are not supported here.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, Callable

from grpo_patches import api, savings
from grpo_patches.refuse_or_note import refuse_or_note

from .calls import worker_train_frame
from .filter import decide, plan
from .state import COUNTERS, CURRENT_V050, FRAMEWORK
from .trim import multiple_of


def _filtered(wrapped: Callable[..., Any], batch: Any, args: tuple, kwargs: dict, dynamic: bool,
              caller: FrameType | None) -> Any:
    frame = worker_train_frame(caller)
    if frame is None:
        return wrapped(*args, **kwargs)
    local = frame.f_locals
    worker, loss_fn = local.get("self"), local.get("loss_fn")
    options = api.active_options(FRAMEWORK)
    on = (options is not None and options.zero_advantage_filter is not False and not local.get("eval_mode", False)
          and type(loss_fn).__name__ == "ClippedPGLossFn")
    if on and options.dropped_rows_metrics:
        refuse_or_note(FRAMEWORK, "zero_advantage_filter", "dropped_rows_metrics=True needs NeMo-RL >= 0.6.0; "
                       "pass dropped_rows_metrics=False")
        on = False
    on = on and decide(loss_fn, worker, batch, packing=bool(getattr(worker, "enable_seq_packing", False)))
    if not on:
        CURRENT_V050.set(None)
        return wrapped(*args, **kwargs)
    mbs = None if dynamic else int(kwargs.get("microbatch_size", args[0] if args else 0))
    multiple = multiple_of(getattr(worker, "cfg", None) or {}, dynamic)
    layout, own = plan(batch, loss_fn, mbs or 1, dynamic, worker.dp_mesh.get_group(), False, multiple=multiple)
    own.global_batches = int(local.get("num_global_batches", 1) or 1)
    own.train_frame = (id(frame), frame.f_code)
    CURRENT_V050.set(own)
    savings.report(FRAMEWORK, **{name: getattr(own, name) for name in COUNTERS if getattr(own, name)})
    return iter(layout.microbatches)


def microbatch_iterator_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``BatchedDataDict.make_microbatch_iterator(microbatch_size)``."""
    return _filtered(wrapped, instance, args, kwargs, False, sys._getframe(1))


def dynamic_iterator_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``BatchedDataDict.make_microbatch_iterator_with_dynamic_shapes()``."""
    return _filtered(wrapped, instance, args, kwargs, True, sys._getframe(1))
