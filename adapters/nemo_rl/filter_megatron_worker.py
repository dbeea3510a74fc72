"""The zero-advantage filter in NeMo-RL's Megatron policy worker (v0.6.0+: ``MegatronPolicyWorkerImpl.train``).

``train()`` gets each global batch from ``process_global_batch`` (``global_valid_seqs`` /
``global_valid_toks`` all-reduced over DP on the whole global batch), then its micro-batches and
their count from ``get_microbatch_iterator``; both names are imported by the worker module from
``nemo_rl.models.megatron.data``, and the worker module's names are wrapped (Ray ships the worker's
methods by value, as for the DTensor worker: :mod:`.worker_train`). The call brackets and the
decision are the DTensor worker's (:class:`~.state.TrainCall`, :func:`.filter.decide`), plus the
Megatron settings not covered yet (:func:`.filter_megatron.problems`).

Exactness: ``LossPostProcessor(num_microbatches=n)`` multiplies each micro-batch's loss by the
``n`` the iterator returned, and Megatron's schedule divides it by the same ``n`` — the wrapped
iterator returns its own count, so the two cancel as upstream and every kept row's loss keeps
the unfiltered global denominators. ``process_global_batch`` / ``aggregate_training_statistics``
bracket every train call whatever the options (the loss finds the call to give the rows whose
prev-logprob pass was skipped their detached current log-probs, :mod:`.skipped_rows`); the
iterator is wrapped only with the filter on. Data-parallel ranks run the same number of micro-batches
(zero-weight pads, :func:`.filter.plan`). Micro-batches keep the global batch's width (no column
trim: the schedule gets one ``seq_length`` for all of them). With pipeline parallelism the schedule
sends every micro-batch's activations between stages in one fixed shape ``[seq_length, mbs, hidden]``:
each micro-batch then gets zero-weight rows (``sample_mask`` 0: loss and gradient exactly 0) up to
``mbs`` rows (:func:`fill_rows`); every stage holds the same rows and makes the same plan.

main adds a split train step (``begin_train_step`` / ``train_microbatch`` / ``finish_train_step``,
NeMo-RL's data plane) that inlines ``process_global_batch``: it is not filtered, and its first
micro-batch notes that (``"auto"``) or raises (``True``). Its gradient could be filtered exactly: each
``train_microbatch`` adds its local valid counts from the whole call's data before it asks
``get_microbatch_iterator``, its loss gets the placeholder ``N = 1`` (raw sums, whose zero-advantage rows
add exactly 0), ``finish_train_step`` all-reduces the counts over DP once and calls
``scale_gradients(1 / N)``, and every DP rank gets every call (``Policy.train_microbatches_from_meta``
shards each slice over all of them), so the wrapped iterator's kept rows and own count would leave all
of that unchanged. What stops it is the metrics: the kept rows' loss metrics are made honest per
micro-batch from the global kept-row counts (:func:`.metrics.adjust_kept_rows`), which here exist only
once ``finish_train_step`` has all-reduced every call's counts, and that step then rescales each metric
by a denominator looked up by its name (``MetricNormalizer``), which the renamed ``*/kept_rows`` keys do
not have; and the train call's bracket (:class:`~.state.TrainCall`, which carries the counters to the
metrics) would have to span separate actor calls. Filtering the gradient without that would log
dropped-row-free averages as if they were NeMo-RL's.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from grpo_patches import api
from grpo_patches.caller_frame import unwrap
from grpo_patches.refuse_or_note import refuse_or_note

from .calls import MEGATRON_WORKER_FILE, arguments, worker_train_frame
from .filter import decide, plan
from .filter_megatron import problems
from .metrics import report_filter_counters
from .settings import setting
from .worker_train import start_call
from .state import ACTIVE_TRAIN, COUNTERS, FRAMEWORK, PREV_IS_CURRENT, TrainCall, active_train


def _begin(frame: Any, loss_fn: Any, data: Any) -> TrainCall:
    local = frame.f_locals
    worker = local.get("self")
    train = TrainCall(worker=worker, loss_fn=loss_fn, frame_id=id(frame), code=frame.f_code)
    options = api.active_options(FRAMEWORK)
    policy_gradient = type(loss_fn).__name__ == "ClippedPGLossFn" and "advantages" in data
    if options is None or options.zero_advantage_filter is False or local.get("eval_mode", False) \
            or not policy_gradient:
        return train
    cfg = getattr(worker, "cfg", None) or {}
    found = problems(cfg, getattr(getattr(worker, "model", None), "config", None), bool(options.dropped_rows_metrics))
    if found:
        refuse_or_note(FRAMEWORK, "zero_advantage_filter", found)
        return train
    train.filter_on = decide(loss_fn, worker, data, packing=bool(setting(cfg, "sequence_packing.enabled", False)))
    return train


#: the model's layout flags ``get_microbatch_iterator`` takes and hands to the processed iterator, where the
#: tag has them (v0.7.0: the first; main: all three; v0.6.0: none)
LAYOUT_FLAGS = ("delegate_pack_to_model", "delegate_mtp_loss_mask_to_model", "model_slices_context_parallel_inputs")


def process_global_batch_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``process_global_batch(data, loss_fn, dp_group, *, batch_idx, batch_size)``, as the Megatron
    worker module names it: a train call begins at its first global batch."""
    start_call(worker_train_frame(sys._getframe(1), MEGATRON_WORKER_FILE), wrapped, args, kwargs, _begin)
    return wrapped(*args, **kwargs)


def fill_rows(microbatch: Any, rows: int) -> Any:
    """``microbatch`` with copies of its last row appended up to ``rows`` rows, their ``sample_mask`` 0."""
    have = int(microbatch["input_ids"].shape[0])
    if have >= rows:
        return microbatch
    filled = microbatch.select_indices(list(range(have)) + [have - 1] * (rows - have))
    mask = filled["sample_mask"].clone()
    mask[have:] = 0
    filled["sample_mask"] = mask
    return filled


def microbatch_iterator_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``get_microbatch_iterator(data, cfg, mbs, straggler_timer, ...)`` -> ``(iterator, count,
    micro_batch_size, seq_length, padded_seq_length)``: the kept rows' micro-batches and their own count."""
    train = active_train()
    if train is None:
        _note_split_step(sys._getframe(1))
    if train is None or not train.filter_on:
        return wrapped(*args, **kwargs)
    from megatron.core import parallel_state

    call = arguments(wrapped, args, kwargs)
    _, _, micro_batch_size, seq_length, padded = wrapped(*args, **kwargs)  # its shapes (its iterator is lazy)
    loss_fn = train.loss_fn
    prev_real = not (getattr(loss_fn, "force_on_policy_ratio", False) or getattr(loss_fn, PREV_IS_CURRENT, False))
    layout, own = plan(call["data"], loss_fn, int(call["mbs"]), False, parallel_state.get_data_parallel_group(),
                       False, keep_dropped=prev_real, multiple=None)
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # fixed-shape activations between stages
        layout.microbatches = [fill_rows(mb, micro_batch_size) for mb in layout.microbatches]
    train.current = own
    for name in COUNTERS:
        setattr(train, name, getattr(train, name) + getattr(own, name))
    data_module = sys.modules[unwrap(wrapped).__module__]  # nemo_rl.models.megatron.data
    iterator = data_module.make_processed_microbatch_iterator(
        raw_iterator=iter(layout.microbatches), cfg=call["cfg"], seq_length_key=call["seq_length_key"],
        pad_individual_seqs_to_multiple_of=1, pad_packed_seq_to_multiple_of=1, straggler_timer=call["straggler_timer"],
        pad_full_seq_to=None, **{name: call[name] for name in LAYOUT_FLAGS if name in call})
    return iterator, len(layout.microbatches), micro_batch_size, seq_length, padded


#: main's split train step (``begin_train_step`` / ``train_microbatch`` / ``finish_train_step``, driven by
#: NeMo-RL's data plane): each call's iterator comes from this method, with no ``process_global_batch``.
SPLIT_STEP_BODY = "_train_microbatch_body"


def _note_split_step(frame: Any) -> None:
    """A micro-batch of main's split train step runs unfiltered: say so (``"auto"``) or refuse (``True``)."""
    for _ in range(4):  # the patching layer's trampoline and wrapt's pure-Python fallback add frames
        if frame is None:
            return
        if frame.f_code.co_name == SPLIT_STEP_BODY and frame.f_code.co_filename.endswith(MEGATRON_WORKER_FILE):
            break
        frame = frame.f_back
    else:
        return
    options = api.active_options(FRAMEWORK)
    loss_fn = (frame.f_locals.get("state") or {}).get("loss_fn")
    if options is None or options.zero_advantage_filter is False or type(loss_fn).__name__ != "ClippedPGLossFn":
        return
    refuse_or_note(FRAMEWORK, "zero_advantage_filter",
                   "the Megatron worker's split train step (begin_train_step / train_microbatch / finish_train_step, "
                   "NeMo-RL's data plane) is not covered by the zero-advantage filter yet: its micro-batches run "
                   "unfiltered; train() is covered")


def aggregate_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``aggregate_training_statistics(...)`` -> ``(mb_metrics, global_loss)``, as the Megatron worker
    module names it: the end of a train call; the filter's counters go into ``mb_metrics``."""
    result = wrapped(*args, **kwargs)
    train = active_train()
    if train is not None:
        if train.filter_on or train.rows_dropped:
            report_filter_counters(train, {"all_mb_metrics": result[0]})
        ACTIVE_TRAIN.set(None)
    return result
