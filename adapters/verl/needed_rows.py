"""Which rows of a rollout batch some loss reads old log-probs of (the minimal pass's plan).

verl's actor update consumes a batch of ``N`` rows as follows, on every line:

* the trainer's dispatch hands data-parallel rank ``r`` the contiguous chunk
  ``[r*N/dp, (r+1)*N/dp)`` (``DataProto.chunk``; Ulysses ranks of one group share a chunk);
* each rank splits its chunk into mini-batches of ``ppo_mini_batch_size * rollout.n / dp`` rows
  and steps the optimizer after each: the 0.7.x legacy actor with ``data.split`` (in order,
  no shuffle); the engine worker (0.8+, or ``use_legacy_worker_impl=disable``) with
  ``tensordict_utils.make_iterator`` (a ``DataLoader`` seeded ``data_loader_seed + rank``,
  ``shuffle`` from the actor config). The first mini-batch is found by running verl's own
  ``make_iterator`` over row indices with the same arguments. Dynamic batch sizes only
  regroup micro-batches inside a mini-batch.

So the rows of each rank's first mini-batch of the first epoch are consumed before any
optimizer step (their old log-probs are the current ones); with ``ppo_epochs >= 2`` every row
is consumed again after a step. With the zero-advantage filter packing rows (on, and
``dropped_rows_metrics=False``), a row whose advantage is exactly 0 on every response token
never reaches a loss that could read them. A wrong prediction cannot train silently: the
worker refuses a placeholder that reaches a loss after a step (:mod:`.row_substitution`).
"""

from __future__ import annotations

from typing import Any

from . import FRAMEWORK
from .config_value import config_value
from .loss_modes import gradient_terms, unsupported_settings


def data_parallel_size(trainer: Any) -> int:
    """The actor's data-parallel size as verl's workers compute it (world size / Ulysses size)."""
    actor = trainer.config.actor_rollout_ref.actor
    world = int(getattr(getattr(trainer, "actor_rollout_wg", None), "world_size", 1) or 1)
    sp = int(actor.get("ulysses_sequence_parallel_size", 1) or 1)
    return max(world // sp, 1)


def pass_shape(trainer: Any, needed: int, rows: int) -> tuple[int, int | None]:
    """``(rows, micro-batch size)`` of the old-logprob pass over ``needed`` of ``rows`` rows: the dispatch
    chunks rows evenly over the data-parallel ranks, and the engine's static micro-batches
    (``prepare_micro_batches``) split each rank's rows into chunks of exactly ``micro_batch_size_per_gpu``.
    With ``M = rollout.log_prob_micro_batch_size_per_gpu`` and ``c`` needed rows per rank, the pass runs
    ``n = ceil(c / M)`` micro-batches of ``ceil(c / n)`` rows (the size handed to the worker in the pass's
    meta data: a forward-only pass, each row's log-probs its own); ``None``: no static size to hand on
    (dynamic batch sizes, the legacy actor: their micro-batches follow the rows)."""
    dp = data_parallel_size(trainer)
    per_rank = -(-needed // dp)
    rollout = trainer.config.actor_rollout_ref.rollout
    if not engine_worker(trainer) or rollout.get("log_prob_use_dynamic_bsz", False):
        return min(per_rank * dp, rows), None
    micro = rollout.get("log_prob_micro_batch_size_per_gpu", None)
    if micro is None and rollout.get("log_prob_micro_batch_size", None) is not None:
        micro = int(rollout.log_prob_micro_batch_size) // dp  # the worker's normalisation of the global size
    calls = max(-(-per_rank // max(int(micro or 1), 1)), 1)
    size = max(-(-per_rank // calls), 1)
    return min(calls * size * dp, rows), size


def engine_worker(trainer: Any) -> bool:
    """Whether the actor updates on verl's engine worker (0.8+, or 0.7 with ``use_legacy_worker_impl=disable``)."""
    from .version import installed

    return installed().release >= (0, 8) or getattr(trainer, "use_legacy_worker_impl", "auto") == "disable"


def filter_drops_zero_rows(trainer: Any) -> bool:
    """Whether the workers' zero-advantage filter packs rows (dropped rows never reach a loss),
    predicted from the options and the actor config exactly as :func:`.zero_advantage.filter_mode` decides."""
    from grpo_patches.zero_advantage import filter_problems

    if not FRAMEWORK.on("zero_advantage_filter") or FRAMEWORK.setting("dropped_rows_metrics"):
        return False
    actor = trainer.config.actor_rollout_ref.actor
    try:
        return not filter_problems(gradient_terms(actor)) and not unsupported_settings(actor)
    except Exception:  # noqa: BLE001  (a config this prediction cannot read: assume the filter is off)
        return False


def first_mini_batch(trainer: Any, rows: int) -> Any:
    """``[rows]`` bool: the rows each data-parallel rank consumes in its first mini-batch."""
    import torch

    actor = trainer.config.actor_rollout_ref.actor
    dp = data_parallel_size(trainer)
    n = int(config_value(trainer.config, "actor_rollout_ref.rollout.n", 1))
    per_rank = rows // dp
    mini = max(int(actor.ppo_mini_batch_size) * n // dp, 1)
    first = torch.zeros(rows, dtype=torch.bool)
    for rank in range(dp):
        local = _engine_first(actor, per_rank, mini, rank) if engine_worker(trainer) else torch.arange(min(mini, per_rank))
        first[rank * per_rank + local] = True
    return first


def _engine_first(actor: Any, per_rank: int, mini: int, rank: int) -> Any:
    """The first mini-batch of verl's own ``make_iterator`` on this rank (indices into its chunk)."""
    import torch
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    index = TensorDict({"row": torch.arange(per_rank)}, batch_size=[per_rank])
    seed = int(actor.get("data_loader_seed", 42))  # what the trainer passes and the worker adds its rank to
    iterator = tu.make_iterator(index, mini_batch_size=mini, epochs=1, seed=seed + rank,
                                dataloader_kwargs={"shuffle": bool(actor.get("shuffle", False))})
    return next(iterator)["row"]


def useful_rows(batch: Any) -> Any:
    """``[rows]`` bool: rows with a non-zero advantage on some response token (the filter's rule; NaN counts)."""
    return useful_rows_of(batch.batch["advantages"], batch.batch["response_mask"])


def useful_rows_of(advantages: Any, mask: Any) -> Any:
    """:func:`useful_rows` of padded ``advantages`` (per token or per row) and ``response_mask``."""
    per_token = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(mask)
    return ((per_token != 0) & (mask != 0)).any(dim=-1)


def needed_rows(trainer: Any, batch: Any, useful: Any = None) -> Any:
    """``[rows]`` bool: the rows whose old log-probs some loss reads (the minimal pass's rows);
    ``useful``: :func:`useful_rows` when the caller has it (the V1 trainer reads it from TransferQueue)."""
    import torch

    actor = trainer.config.actor_rollout_ref.actor
    rows = len(batch)
    if int(actor.get("ppo_epochs", 1)) == 1:
        needed = ~first_mini_batch(trainer, rows)
    else:  # every row is consumed again after a step
        needed = torch.ones(rows, dtype=torch.bool)
    if filter_drops_zero_rows(trainer):
        needed = needed & (useful_rows(batch) if useful is None else useful)
    return needed
