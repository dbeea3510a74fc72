"""The zero-advantage filter with NeMo-RL's Megatron policy worker (v0.6.0+: ``MegatronPolicyWorkerImpl.train``).

``train()`` gets each global batch from ``process_global_batch`` (``global_valid_seqs`` /
``global_valid_toks`` all-reduced over DP on the whole global batch), then its micro-batches and
their count from ``get_microbatch_iterator``; both names are imported by the worker module from
``nemo_rl.models.megatron.data``, and the worker module's names are wrapped (Ray ships the worker's
methods by value, as for the DTensor worker: :mod:`.worker_train`). The call brackets and the
decision are the DTensor worker's (:class:`~.state.TrainCall`, :func:`.zero_advantage.decide`), plus
the Megatron settings not covered yet (:func:`problems`: ``"auto"`` switches the filter off there,
``True`` raises). v0.5.0's Megatron worker is not patched: ``grpo.setup`` (driver, :func:`setup`)
sees the config before any worker exists and says so (a note, or an error for ``True``). Nothing
is imported from the Megatron worker here at import time (it needs Megatron-Bridge).

Exactness: ``LossPostProcessor(num_microbatches=n)`` multiplies each micro-batch's loss by the
``n`` the iterator returned, and Megatron's schedule divides it by the same ``n`` — the wrapped
iterator returns its own count, so the two cancel as upstream and every kept row's loss keeps
the unfiltered global denominators. ``process_global_batch`` / ``aggregate_training_statistics``
bracket every train call whatever the options (the loss finds the call to give the rows whose
prev-logprob pass was skipped their detached current log-probs, :mod:`.placeholders`); the
iterator is wrapped only with the filter on. Data-parallel ranks run the same number of micro-batches
(zero-weight pads, :func:`.zero_advantage.plan`). Micro-batches keep the global batch's width (no column
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

from grpo_patches.call_args import bind
from grpo_patches.caller_frame import unwrap

from . import FRAMEWORK, PACKAGE, frames
from .calls import setting
from .state import COUNTERS, PREV_IS_CURRENT, current_train
from .version import read_version
from .zero_advantage import plan

#: Why the Megatron worker of a tag line (major.minor) is not patched.
NOT_PATCHED = {
    "0.5": "NeMo-RL v0.5.0's Megatron worker is not patched (not run here)",
}


def setup(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``grpo.setup(master_config, ...)`` on a tag whose Megatron worker is not patched: a note
    (``"auto"``) or an error (``True``) for a Megatron policy."""
    config = bind(wrapped, args, kwargs)["master_config"]
    if FRAMEWORK.on("zero_advantage_filter") and setting(config, "policy.megatron_cfg.enabled", False):
        found = read_version(PACKAGE) or ""
        reason = NOT_PATCHED.get(".".join(found.split(".")[:2]), f"NeMo-RL {found}'s Megatron worker is not patched")
        FRAMEWORK.refuse_or_note("zero_advantage_filter", f"{reason}; the zero-advantage filter runs in NeMo-RL "
                                 "v0.6.0+'s Megatron worker and the DTensor worker")
    return wrapped(*args, **kwargs)


def problems(cfg: Any, model_config: Any, dropped_rows_metrics: bool) -> list[str]:
    """The worker's settings (``policy`` config, megatron-core model config) the filter does not cover yet."""
    found = []
    if int(setting(cfg, "megatron_cfg.virtual_pipeline_model_parallel_size", 1) or 1) > 1:
        found.append("virtual pipeline stages (policy.megatron_cfg.virtual_pipeline_model_parallel_size > 1: the "
                     "interleaved schedule) are not covered by the zero-advantage filter with the Megatron worker "
                     "yet (pipeline parallelism without them is); unset it")
    if int(setting(cfg, "megatron_cfg.context_parallel_size", 1) or 1) > 1:
        found.append("context parallelism (policy.megatron_cfg.context_parallel_size > 1) is not covered by the "
                     "zero-advantage filter with the Megatron worker yet; set it to 1")
    if setting(cfg, "dynamic_batching.enabled", False):
        found.append("dynamic batching with the Megatron worker is not covered by the zero-advantage filter yet; "
                     "set policy.dynamic_batching.enabled=false")
    if dropped_rows_metrics:
        found.append("dropped_rows_metrics=True is not supported with NeMo-RL's Megatron worker yet; "
                     "pass dropped_rows_metrics=False")
    if int(getattr(model_config, "mtp_num_layers", None) or 0) > 0:
        found.append("multi-token prediction (mtp_num_layers > 0) trains every row's tokens, so zero-advantage rows "
                     "have a gradient; turn it off or pass zero_advantage_filter=False")
    if setting(cfg, "draft.enabled", False):
        found.append("the draft model (policy.draft.enabled) trains on every row; turn it off or pass "
                     "zero_advantage_filter=False")
    return found


#: the model's layout flags ``get_microbatch_iterator`` takes and hands to the processed iterator, where the
#: tag has them (v0.7.0: the first; main: all three; v0.6.0: none)
LAYOUT_FLAGS = ("delegate_pack_to_model", "delegate_mtp_loss_mask_to_model", "model_slices_context_parallel_inputs")


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


def get_microbatch_iterator(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``get_microbatch_iterator(data, cfg, mbs, straggler_timer, ...)`` -> ``(iterator, count,
    micro_batch_size, seq_length, padded_seq_length)``: the kept rows' micro-batches and their own count."""
    train = current_train()
    if train is None:
        _note_split_step()
    if train is None or not train.filter_on:
        return wrapped(*args, **kwargs)
    from megatron.core import parallel_state

    call = bind(wrapped, args, kwargs)
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



def _note_split_step() -> None:
    """A micro-batch of main's split train step (:data:`.frames.SPLIT_STEP_BODY`) runs unfiltered: say so
    (``"auto"``) or refuse (``True``)."""
    found, loss_fn = frames.split_step_loss_fn()
    if not found or not FRAMEWORK.on("zero_advantage_filter") or type(loss_fn).__name__ != "ClippedPGLossFn":
        return
    FRAMEWORK.refuse_or_note("zero_advantage_filter", "the Megatron worker's split train step (begin_train_step / "
                             "train_microbatch / finish_train_step, NeMo-RL's data plane) is not covered by the "
                             "zero-advantage filter yet: its micro-batches run unfiltered; train() is covered")
