"""The zero-advantage filter in the DTensor policy worker v2 (``DTensorPolicyWorkerV2Impl``), v0.6.0 and later.

``train()`` computes ``global_valid_seqs`` / ``global_valid_toks`` on the whole global batch
(``process_global_batch``, all-reduced over DP) and then asks the worker module's
``get_microbatch_iterator`` (imported there by name from ``nemo_rl.models.automodel.data``)
for the micro-batches. That name is wrapped: inside a train call whose filter is on
(:class:`~.state.TrainCall`, :mod:`.worker_train`) it returns the micro-batches of
:func:`.zero_advantage.plan` through NeMo-RL's own ``make_processed_microbatch_iterator``, and
their count as the number of valid micro-batches. The same name serves ``get_logprobs``,
``score`` and ``get_topk_logits``: they run outside a train call and see every row.

With ``dropped_rows_metrics=True`` the dropped rows follow as metrics-only micro-batches, run
without autograd (:mod:`.dropped_rows`).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from grpo_patches.call_args import bind
from grpo_patches.caller_frame import unwrap

from . import FRAMEWORK
from .calls import setting
from .state import COUNTERS, PREV_IS_CURRENT, current_train
from .trim import multiple_of
from .zero_advantage import plan


def get_microbatch_iterator(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``get_microbatch_iterator(data, cfg, mbs, dp_mesh, tokenizer, cp_size=1)``."""
    train = current_train()
    if train is None or not train.filter_on:
        return wrapped(*args, **kwargs)
    call = bind(wrapped, args, kwargs)
    metrics_for_dropped = FRAMEWORK.on("dropped_rows_metrics")
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
