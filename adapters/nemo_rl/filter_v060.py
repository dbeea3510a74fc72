"""The zero-advantage filter in the DTensor policy worker v2 (``DTensorPolicyWorkerV2Impl``), v0.6.0 and later.

``train()`` computes ``global_valid_seqs`` / ``global_valid_toks`` on the whole global batch
(``process_global_batch``, all-reduced over DP) and then asks the worker module's
``get_microbatch_iterator`` (imported there by name from ``nemo_rl.models.automodel.data``)
for the micro-batches. That name is wrapped: inside a train call whose filter is on
(:mod:`.worker_train`) it returns the micro-batches of :func:`.filter.plan` through
NeMo-RL's own ``make_processed_microbatch_iterator``, and their count as the number of valid
micro-batches. The same name serves ``get_logprobs``, ``score`` and ``get_topk_logits``: they
run outside a train call and see every row.

With ``dropped_rows_metrics=True`` the dropped rows follow as metrics-only micro-batches:
``forward_with_post_processing_fn`` (``nemo_rl.models.automodel.train``) runs them without
autograd and hands NeMo-RL a zero loss with no graph, so its ``backward()`` costs nothing and
their metrics are NeMo-RL's own.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from grpo_patches import api
from grpo_patches.caller_frame import unwrap

from .calls import arguments
from .filter import plan
from .settings import setting
from .state import COUNTERS, FRAMEWORK, PREV_IS_CURRENT, active_train
from .trim import multiple_of


def microbatch_iterator_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``get_microbatch_iterator(data, cfg, mbs, dp_mesh, tokenizer, cp_size=1)``."""
    train = active_train()
    if train is None or not train.filter_on:
        return wrapped(*args, **kwargs)
    call = arguments(wrapped, args, kwargs)
    options = api.active_options(FRAMEWORK)
    metrics_for_dropped = bool(options and options.dropped_rows_metrics)
    loss_fn = train.loss_fn
    prev_real = not (getattr(loss_fn, "force_on_policy_ratio", False) or getattr(loss_fn, PREV_IS_CURRENT, False))
    dynamic = bool(setting(call["cfg"], "dynamic_batching.enabled"))
    layout, own = plan(call["data"], loss_fn, int(call["mbs"]), dynamic, call["dp_mesh"].get_group(), metrics_for_dropped,
                       keep_dropped=prev_real and not metrics_for_dropped, multiple=multiple_of(call["cfg"], dynamic))
    train.current = own
    for name in COUNTERS:
        setattr(train, name, getattr(train, name) + getattr(own, name))
    microbatches = layout.microbatches + layout.metrics_only
    data_module = sys.modules[unwrap(wrapped).__module__]  # nemo_rl.models.automodel.data
    iterator = data_module.make_processed_microbatch_iterator(iter(microbatches), call["tokenizer"], call["cfg"],
                                                              call["cp_size"])
    return iterator, len(microbatches)


def metrics_only_forward_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``forward_with_post_processing_fn(model, post_processing_fn, processed_mb, ...)``: a
    metrics-only micro-batch runs without autograd and returns a zero loss with no graph."""
    train = active_train()
    own = train.current if train is not None else None
    if own is None or not own.metrics_only:
        return wrapped(*args, **kwargs)
    processed = arguments(wrapped, args, kwargs)["processed_mb"]
    if not own.is_metrics_only(processed.data_dict):
        return wrapped(*args, **kwargs)
    import torch

    with torch.no_grad():
        result, metrics, processed = wrapped(*args, **kwargs)
    return torch.zeros((), dtype=result.dtype, device=result.device, requires_grad=True), metrics, processed
