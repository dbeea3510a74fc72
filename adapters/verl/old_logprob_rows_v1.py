"""The minimal old-logprob pass (option ``recompute``) on verl 0.9's V1 trainer (TransferQueue).

The V1 ``PPOTrainer`` passes data by keys: each stage reads and writes fields of the batch's
keys in TransferQueue and hands on a ``KVBatchMeta``. The legacy trainer's minimal pass
(:mod:`.old_logprob_rows`) carries over key for key:

* ``_compute_old_log_prob`` (wrapped) defers the pass: it writes the row-level placeholder
  (:func:`.placeholders.rows_like`, jagged as ``response_mask``) as every key's ``old_log_probs``
  and no ``entropy`` (no ``actor/entropy`` from the trainer: the subset's would not be the batch's);
* ``_update_actor`` (wrapped), once the advantages are in TransferQueue and before any weight
  changes (the reference, critic and advantage stages leave the actor alone and read no old
  log-probs in the configs deferred), runs verl's own ``_compute_old_log_prob`` on the
  ``KVBatchMeta.select_keys`` of the rows of :func:`.needed_rows.needed_rows` (the
  update's order: ``_balance_batch`` has already reordered the keys the dispatch chunks),
  topped up with unneeded rows (keys are unique: no repeats; those rows just get real old
  log-probs) to fill as few micro-batches as static batching allows, whose size it carries
  (:func:`.needed_rows.pass_shape`). verl's pass writes their ``old_log_probs``; the others keep
  the placeholder, which the engine worker replaces by the detached current log-probs before
  the first optimizer step or refuses (:mod:`.row_substitution`), and the update must
  confirm it did (:mod:`.skip_guarantee`).

Saving: ``grpo_patches/old_logprob_rows_skipped`` in the step's metrics (and ``status()``).
The full pass runs, with the reason in ``status()``, in the legacy wrapper's cases and when the
trainer class overrides ``_compute_old_log_prob`` (the separate-async trainer's version-aware pass).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from grpo_patches.call_args import bind

from . import FRAMEWORK
from . import metrics as verl_metrics
from . import placeholders
from .needed_rows import needed_rows, pass_shape, useful_rows_of
from .old_logprob_rows import deferral, note_computed, take_deferred
from .old_logprobs_v1 import needed_elsewhere, nested_like
from .skip_guarantee import expect_substitution


def _tq() -> Any:
    from verl.trainer.ppo.v1 import trainer_base

    return trainer_base.tq  # the binding verl's stages call (a test may replace it)


def _overrides_the_pass(trainer: Any) -> str | None:
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    for cls in type(trainer).__mro__:
        if cls is PPOTrainer:
            return None
        if "_compute_old_log_prob" in vars(cls):
            return f"{cls.__qualname__} overrides _compute_old_log_prob (its own pass runs on every row)"
    return None


def compute_old_log_prob(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the V1 ``PPOTrainer._compute_old_log_prob(batch, metrics) -> KVBatchMeta``: defer it."""
    if not FRAMEWORK.on("recompute") or instance is None:
        return wrapped(*args, **kwargs)
    batch = bind(wrapped, args, kwargs)["batch"]
    own = deferral(instance, len(batch), lambda: needed_elsewhere(instance), lambda: _overrides_the_pass(instance))
    if own is None:
        return wrapped(*args, **kwargs)
    from tensordict import TensorDict

    tq = _tq()
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["response_mask"])
    mask = data["response_mask"]
    old = nested_like(mask, placeholders.rows_like(mask.values() if mask.is_nested else mask))
    own.deferred = (wrapped, copy.deepcopy(batch.extra_info))  # the pass's metadata as verl would have sent it
    return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                           fields=TensorDict({"old_log_probs": old}, batch_size=data.batch_size))


def update_actor(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of the V1 ``PPOTrainer._update_actor(batch, metrics)``: the deferred pass on the needed rows."""
    deferred = take_deferred(instance)
    if deferred is None:
        return wrapped(*args, **kwargs)
    call = bind(wrapped, args, kwargs)
    batch, metrics = call["batch"], call["metrics"]
    data = _tq().kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                              select_fields=["advantages", "response_mask"]).to_padded_tensor()
    needed = needed_rows(instance, batch, useful_rows_of(data["advantages"], data["response_mask"]))
    computed = _run_pass(*deferred, instance, batch, needed)
    if computed < len(batch):
        expect_substitution(instance, "rows")  # the update must confirm that its workers substituted
    output = wrapped(*args, **kwargs)
    verl_metrics.report(metrics, old_logprob_rows_skipped=len(batch) - computed)
    note_computed(instance, computed, len(batch))
    return output


def _run_pass(deferred: Callable[..., Any], extra_info: dict, trainer: Any, batch: Any, needed: Any) -> int:
    """verl's pass on the keys of the ``needed`` rows (topped up to :func:`.needed_rows.pass_shape`); rows computed."""
    import torch

    index = torch.nonzero(needed).flatten().tolist()
    if not index:
        return 0
    target, size = pass_shape(trainer, len(index), len(batch))
    chosen = set(index)
    index += [i for i in range(len(batch)) if i not in chosen][: target - len(index)]
    subset = batch.select_keys([batch.keys[i] for i in sorted(index)])
    subset.extra_info = copy.deepcopy(extra_info)
    if size is not None:
        subset.extra_info["micro_batch_size_per_gpu"] = size  # the worker's infer_batch keeps a size it is given
    deferred(subset, {})  # its actor/entropy would be the subset's: not logged
    return len(index)
