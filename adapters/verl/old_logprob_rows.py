"""The minimal old-logprob pass (option ``recompute``): trainer side of verl's ``RayPPOTrainer``.

verl runs the old-logprob pass on every row of every batch. With ``k`` mini-batches, the rows
each data-parallel rank consumes in its first mini-batch of the first epoch are read before
any optimizer step (their old log-probs are the current ones), and with the zero-advantage
filter packing rows a row whose advantage is exactly 0 never reaches a loss. So:

* ``_compute_old_log_prob`` (wrapped) defers the pass: the trainer gets the row-level
  placeholder (:mod:`.placeholders`) for ``old_log_probs`` (and ``entropys``: the trainer's
  ``actor/entropy`` is NaN, i.e. not computed, and ``perf/mfu/actor_infer`` too);
* ``_update_actor`` (wrapped), once the advantages exist and before any weight changes
  (verl's reference, critic and advantage stages in between leave the actor alone and read
  no old log-probs), runs verl's own ``_compute_old_log_prob`` on the rows of
  :func:`.needed_rows.needed_rows` (``DataProto.select_idxs``, padded with repeats of its
  first row to fill as few micro-batches as the workers' dispatch and static batching allow,
  whose size it carries: :func:`.needed_rows.pass_shape`) and scatters them back; the other rows keep the placeholder, which the patched worker
  replaces by the detached current log-probs in the loss (:mod:`.row_substitution`),
  and the update must confirm it did (:mod:`.skip_guarantee`), or the run stops.

Saving: ``grpo_patches/old_logprob_rows_skipped`` in the update's metrics (and ``status()``):
the rows verl's pass would have computed (the whole batch) minus those the pass ran on.
The full pass runs, with the reason in ``status()``, when something else reads the old
log-probs, when one optimizer step consumes the batch (``logprob_skip``'s case), when the
trainer class's ``fit`` has no path to ``_update_actor`` (a recipe's own loop calling the workers:
:func:`grpo_patches.call_reach.reaches`), when every row is needed, under verify mode, on the Megatron workers, or when the workers do not substitute.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches import call_reach
from grpo_patches.call_args import bind

from . import FRAMEWORK
from . import metrics as verl_metrics
from . import placeholders, state
from .config_value import config_value
from .needed_rows import data_parallel_size, filter_drops_zero_rows, needed_rows, pass_shape
from .old_logprobs import NOTE, needed_elsewhere
from .skip_guarantee import expect_substitution, workers_substitute_rows


def compute_old_log_prob(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``RayPPOTrainer._compute_old_log_prob(batch) -> (DataProto, mfu)``: defer the pass."""
    if not FRAMEWORK.on("recompute") or instance is None:
        return wrapped(*args, **kwargs)
    batch = bind(wrapped, args, kwargs)["batch"]
    own = deferral(instance, len(batch), lambda: needed_elsewhere(instance, batch))
    if own is None:
        return wrapped(*args, **kwargs)
    from verl import DataProto

    own.deferred = wrapped
    mask = batch.batch["response_mask"]
    return DataProto.from_dict(tensors={"old_log_probs": placeholders.rows_like(mask),
                                        "entropys": placeholders.rows_like(mask)}), float("nan")


def deferral(trainer: Any, rows: int, elsewhere: Callable[[], str | None],
             overridden: Callable[[], str | None] = lambda: None) -> Any | None:
    """The trainer's state (``deferred`` cleared) when its pass over ``rows`` rows is deferred, else
    ``None`` with the reason noted; ``elsewhere``: what else reads the old log-probs, ``overridden``: a
    trainer-class reason checked first. Both trainer lines' ``_compute_old_log_prob`` wrappers start here."""
    if not FRAMEWORK.on("recompute") or trainer is None:
        return None
    own = state.trainer(trainer)
    own.deferred = None
    why = overridden() or why_every_row(trainer, rows, elsewhere())
    if why is not None:
        if why:  # "" : logprob_skip's case, noted by its own wrapper
            FRAMEWORK.note(NOTE, f"computed for every row: {why}", owner=trainer)
        return None
    FRAMEWORK.note(NOTE, "deferred to the update: computed only for the rows a loss reads after an optimizer "
                   "step (recompute)", owner=trainer)
    return own


def take_deferred(trainer: Any) -> Any | None:
    """The pass ``deferral`` left on ``trainer`` (taken off it: it runs once), or ``None``."""
    own = state.trainer(trainer) if trainer is not None else None
    deferred = own.deferred if own is not None else None
    if deferred is not None:
        own.deferred = None
    return deferred


def update_actor(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``RayPPOTrainer._update_actor(batch)``: run the deferred pass on the needed rows."""
    deferred = take_deferred(instance)
    if deferred is None:
        return wrapped(*args, **kwargs)
    batch = bind(wrapped, args, kwargs)["batch"]
    needed = needed_rows(instance, batch)
    computed = _run_pass(deferred, instance, batch, needed)
    if not bool(needed.all()):
        expect_substitution(instance, "rows")  # the update must confirm that its workers substituted
    output = wrapped(*args, **kwargs)
    skipped = len(batch) - computed
    verl_metrics.report(getattr(output, "meta_info", {}).setdefault("metrics", {}), old_logprob_rows_skipped=skipped)
    note_computed(instance, computed, len(batch))
    return output


def note_computed(trainer: Any, computed: int, rows: int) -> None:
    """``status()``: the minimal pass of ``trainer``'s last step ran on ``computed`` of ``rows`` rows."""
    FRAMEWORK.note(NOTE, f"minimal pass (recompute): {computed} of {rows} rows computed in the last step", owner=trainer)


def _run_pass(deferred: Callable[..., Any], trainer: Any, batch: Any, needed: Any) -> int:
    """verl's pass on the ``needed`` rows (padded for the dispatch), scattered into ``batch``; rows computed."""
    import torch

    index = torch.nonzero(needed).flatten()
    if index.numel() == 0:
        return 0
    target, size = pass_shape(trainer, int(index.numel()), len(batch))
    pad = target - index.numel()
    rows = torch.cat([index, index[:1].repeat(pad)]) if pad else index
    subset = batch.select_idxs(rows)
    subset.meta_info = dict(batch.meta_info)  # select_idxs shares the dict: the update reads the batch's own
    if size is not None:
        subset.meta_info["micro_batch_size_per_gpu"] = size  # the engine worker's infer_batch keeps a size it is given
    if "global_token_num" in batch.meta_info:  # verl's MFU estimate reads one length per row
        subset.meta_info["global_token_num"] = [batch.meta_info["global_token_num"][i] for i in rows.tolist()]
    out, _ = deferred(subset)
    old = batch.batch["old_log_probs"].clone()
    old[index] = out.batch["old_log_probs"][: index.numel()].to(old.dtype)
    batch.batch["old_log_probs"] = old
    return int(rows.numel())


def why_every_row(trainer: Any, rows: int, elsewhere: str | None) -> str | None:
    """Why the pass runs on every one of ``rows`` now (``""``: logprob_skip's whole-batch case), or
    ``None``: deferred; ``elsewhere``: what else reads the old log-probs (the trainer's own check)."""
    actor = trainer.config.actor_rollout_ref.actor
    dp = data_parallel_size(trainer)
    n = int(config_value(trainer.config, "actor_rollout_ref.rollout.n", 1))
    mini_batches = -(-(rows // dp) // max(int(actor.ppo_mini_batch_size) * n // dp, 1))
    epochs = int(actor.get("ppo_epochs", 1))
    if mini_batches * epochs <= 1:
        if FRAMEWORK.on("logprob_skip"):
            return ""
        return "one optimizer step consumes the batch (logprob_skip=False runs it)"
    if elsewhere:
        return elsewhere
    if not call_reach.reaches(type(trainer), "fit", "_update_actor"):
        return f"{type(trainer).__qualname__}.fit never calls _update_actor, where the deferred pass runs"
    if epochs > 1 and not filter_drops_zero_rows(trainer):
        return "every row is read after an optimizer step (ppo_epochs > 1, no zero-advantage filter dropping rows)"
    if FRAMEWORK.setting("verify_every") is not None:
        return "verify mode (verify_every) compares the whole pass"
    if config_value(trainer.config, "actor_rollout_ref.actor.strategy", "fsdp") == "megatron":
        return "the Megatron workers have no row substitution"
    if config_value(trainer.config, "actor_rollout_ref.actor.router_replay.mode", "disabled") != "disabled":
        return "router replay reads the pass's routed experts"
    if rows % dp:
        return f"{rows} rows do not split evenly over {dp} data-parallel ranks"
    why = workers_substitute_rows(trainer)
    return f"the workers do not substitute skipped rows: {why}" if why else None
