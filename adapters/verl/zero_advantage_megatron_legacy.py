"""Zero-advantage filter for verl's legacy Megatron actor (0.6.1-0.7.x): ``MegatronPPOActor``.

The legacy Megatron worker (``use_legacy_worker_impl``; ``verl.workers.megatron_workers``) calls
``MegatronPPOActor.update_policy``, which runs ``forward_backward_batch`` once per mini-batch
(one optimizer step each). There each micro-batch's loss is verl's ``agg_loss`` over that
micro-batch alone (its own tokens or rows: :data:`.loss_modes.DENOMINATORS`, as in the legacy
``dp_actor``), and Megatron's schedule divides it by the micro-batch count ``M`` (verl's loss
returns ``(loss, metrics)``, so no per-token count: under ``calculate_per_token_loss`` Megatron's
token count stays 0 with or without the filter, and every gradient is scaled by 1 either way).
A row's gradient coefficient is therefore ``1 / (M * D_m)``, set by its micro-batch ``m``.

* ``forward_backward_batch`` (wrapped, training calls only): the ``grpo_filter_zero_advantage``
  hook picks the rows of the mini-batch to keep (the same count on every data-parallel rank);
  each kept row's ORIGINAL coefficient ``1 / (M * D_m)`` is taken from verl's own micro-batch
  split of the unfiltered mini-batch (static ``split(micro_batch_size)`` or dynamic
  ``rearrange_micro_batches``) and carried in ``rollout_is_weights``, the per-token weight
  verl's policy losses multiply in before ``agg_loss``.
* ``make_batch_generator`` (``megatron_actor``'s binding, inert outside a filtered update):
  receives verl's micro-batches of the kept rows; each one's carrier is divided by its own
  coefficient ``1 / (M' * D')``, so every kept row ends with exactly its original gradient.
* every pipeline stage and tensor-parallel rank holds the same mini-batch (verl dispatches one
  data-parallel shard to the whole model-parallel group and broadcasts it over the pipeline), so
  they make the same decision and run the same number of micro-batches; data-parallel ranks keep
  the same row count (the hook) and verl's dynamic split syncs its micro-batch count over them.
* ``update_policy`` (wrapped): the saving in verl's metrics (``grpo_patches/rows_dropped``).

Metrics: ``actor/pg_loss`` keeps verl's sum and mean (each original micro-batch reports its
mini-batch's loss); the other per-micro-batch metrics are over the kept rows
(``<name>/kept_rows``). Not covered (``"auto"``: off with the reason in ``status()``;
``True`` raises): what :func:`.zero_advantage_megatron.megatron_problems` lists, router replay,
multi-modal inputs (never filtered).
"""

from __future__ import annotations

import types
from typing import Any, Callable

from grpo_patches.call_args import bind

from . import metrics as verl_metrics
from . import state
from .loss_modes import denominator, effective_agg_mode, line_of
from .multimodal import has_multimodal_inputs
from .version import installed as verl_version
from .zero_advantage import filter_mode
from .zero_advantage_legacy import micro_denominator
from .zero_advantage_megatron import megatron_problems

PG_LOSS = "actor/pg_loss"
#: per-micro-batch metrics the filter leaves unchanged
UNCHANGED = ("actor/kl_coef",)


def legacy_problems(actor: Any) -> tuple[str, ...]:
    """Settings of a legacy Megatron actor the filter does not cover (each one named)."""
    view = types.SimpleNamespace(engine_config=actor.config.megatron, tf_config=getattr(actor, "tf_config", None),
                                 model_config=types.SimpleNamespace(mtp=getattr(actor, "mtp_config", None)))
    problems = list(megatron_problems(view))
    replay = getattr(actor.config, "router_replay", None)
    mode = getattr(replay, "mode", "disabled") if replay is not None else "disabled"
    if mode not in (None, "disabled"):
        problems.append(f"actor.router_replay.mode={mode!r} (router replay) is not covered yet")
    return tuple(problems)


def update_policy(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``MegatronPPOActor.update_policy(dataloader)``: counts, into verl's metrics."""
    if instance is None or getattr(instance, "actor_optimizer", None) is None \
            or state.update().zero_advantage is not None:
        return wrapped(*args, **kwargs)
    update = state.ZeroAdvantageUpdate(instance, None)  # the mode: decided at the first training forward_backward_batch
    with state.in_update(zero_advantage=update):
        out = wrapped(*args, **kwargs)
    if update.mode is not None:
        epochs = max(int(instance.config.ppo_epochs), 1)  # the rows of the batch, not of every epoch
        verl_metrics.report(out, rows_dropped=update.rows_dropped // epochs,
                            tokens_dropped=update.tokens_dropped // epochs, padding_rows=update.padding_rows // epochs)
    return out


def forward_backward_batch(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``MegatronPPOActor.forward_backward_batch(data, forward_only=False, ...)``."""
    call = bind(wrapped, args, kwargs)
    data, update = call["data"], state.update().zero_advantage
    if instance is None or update is None or call["forward_only"] or "advantages" not in data.batch.keys() \
            or has_multimodal_inputs(data.non_tensor_batch.get("multi_modal_inputs")):
        return wrapped(*args, **kwargs)
    update.mode = filter_mode(instance, instance.config, extra_problems=legacy_problems(instance))
    if update.mode is None:
        return wrapped(*args, **kwargs)
    kind = denominator(line_of(verl_version()), effective_agg_mode(instance.config))
    original = _original_parts(data, call)
    filtered = _filtered(data, original, kind, update)
    packed = state.PackedBatch(denominator=kind)
    with state.in_update(packed=packed):
        out = call.call(wrapped, data=filtered)
    _rewrite_metrics(out, len(original), packed.micro_batches)
    return out


def _original_parts(data: Any, call: Any) -> list[list[int]]:
    """The rows of each micro-batch verl makes of the unfiltered mini-batch."""
    rows = len(data)
    if not call["use_dynamic_bsz"]:
        size = int(call["micro_batch_size"])
        return [list(range(i, min(i + size, rows))) for i in range(0, rows, size)]
    from megatron.core import parallel_state as mpu
    from packaging.version import Version
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    batch = data.batch.select("attention_mask", "input_ids")
    extra = {"dp_group": mpu.get_data_parallel_group()} if verl_version() >= Version("0.7.0") else {}
    _, parts = rearrange_micro_batches(batch=batch, max_token_len=call["max_token_len"], **extra)
    return [list(p) for p in parts]


def _filtered(data: Any, parts: list[list[int]], kind: str, update: state.ZeroAdvantageUpdate) -> Any:
    """The kept rows, with each one's original coefficient (times the hook's weight) in ``rollout_is_weights``."""
    import torch
    from megatron.core import parallel_state as mpu

    from grpo_patches.plugins import hook

    adv, mask = data.batch["advantages"], data.batch["response_mask"]
    coefficients = torch.zeros(len(data), dtype=torch.float64)
    for part in parts:
        index = torch.as_tensor(part, dtype=torch.long)
        d = micro_denominator(mask[index], kind)
        coefficients[index] = 1.0 / (len(parts) * d) if d > 0 else 0.0
    plan = hook().grpo_filter_zero_advantage(advantages=adv, mask=mask, denominator="fixed",
                                             group=mpu.get_data_parallel_group())
    if plan is None:  # a plugin declined: every row, at its own coefficient
        keep, weights = torch.arange(len(data)), torch.ones(len(data), dtype=torch.float64)
    else:
        keep, weights = plan.keep.cpu(), plan.weights.cpu().to(torch.float64)
        update.rows_dropped += plan.rows_dropped
        update.tokens_dropped += plan.tokens_dropped
        update.padding_rows += plan.padding_rows
    if keep.numel() == 0:  # Megatron runs at least one micro-batch: one row that weighs nothing
        keep, weights = torch.arange(1), torch.zeros(1, dtype=torch.float64)
    filtered = data.select_idxs(keep)
    carrier = (coefficients[keep] * weights)[:, None].expand(-1, mask.shape[-1])
    if "rollout_is_weights" in filtered.batch.keys():
        carrier = carrier * filtered.batch["rollout_is_weights"].to(torch.float64)
    filtered.batch["rollout_is_weights"] = carrier.contiguous()  # float64: divided per micro-batch
    return filtered


def make_batch_generator(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``megatron_actor.make_batch_generator(batches, vpp_size)``: each micro-batch's
    carrier divided by the coefficient ``1 / (M' * D')`` verl and Megatron give its rows."""
    packed = state.update().packed
    if packed is None:
        return wrapped(*args, **kwargs)
    import torch

    call = bind(wrapped, args, kwargs)
    batches = list(call["batches"])
    for micro in batches:
        d = micro_denominator(micro["response_mask"], packed.denominator)
        own = 1.0 / (len(batches) * d) if d > 0 else 1.0
        micro["rollout_is_weights"] = (micro["rollout_is_weights"] / own).to(torch.float32)
    packed.micro_batches = len(batches)
    return call.call(wrapped, batches=batches)


def _rewrite_metrics(out: Any, original: int, packed: int) -> None:
    """On the last pipeline stage: ``actor/pg_loss`` with verl's sum and mean (one value per original
    micro-batch: the mini-batch's loss), the other per-micro-batch metrics renamed ``/kept_rows``."""
    entries = out.get("output") if isinstance(out, dict) else None
    if not entries or not packed:
        return
    total = 0.0
    for metrics, *_ in entries:
        total += sum(float(v) for v in metrics.pop(PG_LOSS, []))
        verl_metrics.rename_kept_rows(metrics, UNCHANGED)
    mean = total / packed  # the mini-batch's loss: sum over micro-batches of loss / M'
    for i in range(original):
        if i < len(entries):
            entries[i][0][PG_LOSS] = [mean]
        else:
            entries.append([{PG_LOSS: [mean]}, None])
