"""Zero-advantage filter for verl's legacy ``DataParallelPPOActor`` (0.6.1-0.7.1).

Default (``"pack"``): zero-advantage rows leave the update entirely, and the kept rows are
packed into fewer micro-batches, so the dropped rows cost no forward and no backward.

* ``update_policy`` (wrapped): per mini-batch (rows ``[j*mini, (j+1)*mini)``, verl's own
  ``data.split(ppo_mini_batch_size)``), the ``grpo_filter_zero_advantage`` hook picks the
  rows to keep (the same count on every data-parallel rank). Each kept row's ORIGINAL loss
  coefficient ``c = s_m / D_m`` is taken from verl's own micro-batch split of the unfiltered
  mini-batch (``s_m``: verl's ``loss_scale_factor``; ``D_m``: the agg_loss denominator of
  :data:`.loss_modes.DENOMINATORS`), and carried in ``rollout_is_weights``, the per-token
  weight verl's policy losses multiply in before ``agg_loss``.
* ``DataProto.split`` (wrapped, inert otherwise): the filtered batch's split into
  mini-batches returns the planned variable-size mini-batches, so mini-batch membership, the
  number of optimizer steps and verl 0.6-0.7's ``on_policy`` shortcut never change.
* ``_forward_micro_batch`` (wrapped): receives the very dict verl then reads
  ``rollout_is_weights`` from; it divides the carrier by the packed micro-batch's own
  coefficient ``s'/D'``, so every row ends with exactly its original gradient whatever
  micro-batches verl makes (static or dynamic).
* ``prepare_dynamic_batch`` (dp_actor's binding): under data parallelism every rank is asked
  for the same number of micro-batches (0.7.1 does not pass its dp group there).

``dropped_rows_metrics=True`` (``"nograd"``): verl's micro-batches stay as they are; in each,
the kept rows run with autograd and the dropped rows in a no-grad forward, so every metric
is verl's own (:mod:`.dropped_rows_legacy`). Metrics of the default mode: see
:func:`update_policy`.

Without remove-padding, each packed micro-batch's training forward runs on the columns its
rows use (:mod:`.trim_legacy`; ``grpo_patches/padding_tokens_skipped``).
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import bind

from . import metrics as verl_metrics
from . import state, trim_legacy
from .dropped_rows_legacy import split_forward, world_size
from .loss_modes import denominator, effective_agg_mode, line_of
from .multimodal import has_multimodal_inputs
from .version import installed as verl_version
from .zero_advantage import filter_mode

#: update_policy metrics the filter provably leaves unchanged (0.7: pg_loss is a float sum).
UNCHANGED = ("actor/grad_norm", "actor/kl_coef", "actor/lr")


def micro_denominator(mask: Any, kind: str) -> float:
    """``D`` of one micro-batch: its tokens, its rows with >= 1 token, or 1 (fixed)."""
    import torch

    if kind == "tokens":
        return float(mask.to(torch.float64).sum())
    if kind == "rows":
        return float((mask.sum(-1) > 0).sum())
    return 1.0


def _scale(config: Any, rows: int) -> float:
    """verl's ``loss_scale_factor`` of a micro-batch (dp_actor update_policy)."""
    if config.use_dynamic_bsz:
        return rows / config.ppo_mini_batch_size
    return 1.0 / (config.ppo_mini_batch_size // config.ppo_micro_batch_size_per_gpu)


def _original_coefficients(actor: Any, mini: Any, kind: str) -> Any:
    """``c_r = s_m / D_m`` of every row of one mini-batch, from verl's own micro-batch split."""
    import torch

    config = actor.config
    rows = len(mini)
    mask = mini.batch["response_mask"]
    if config.use_dynamic_bsz:
        from verl.utils.seqlen_balancing import prepare_dynamic_batch

        max_token_len = config.ppo_max_token_len_per_gpu * actor.ulysses_sequence_parallel_size
        _, parts = prepare_dynamic_batch(mini, max_token_len=max_token_len)
    else:
        size = config.ppo_micro_batch_size_per_gpu
        parts = [list(range(i, min(i + size, rows))) for i in range(0, rows, size)]
    coefficients = torch.zeros(rows, dtype=torch.float64)
    for part in parts:
        index = torch.as_tensor(part, dtype=torch.long)
        d = micro_denominator(mask[index], kind)
        coefficients[index] = _scale(config, len(part)) / d if d > 0 else 0.0
    return coefficients


def _plan(actor: Any, data: Any, update: state.ZeroAdvantageUpdate) -> tuple[Any, list[int]]:
    """The filtered batch (kept rows, carrier weights) and the size of each mini-batch."""
    import torch

    from grpo_patches.plugins import hook

    config = actor.config
    adv, mask = data.batch["advantages"], data.batch["response_mask"]
    mini_size = config.ppo_mini_batch_size
    kept, carriers, sizes = [], [], []
    for start in range(0, len(data), mini_size):
        mini = data[start : start + mini_size]
        rows = len(mini)
        # "fixed": the adapter gives each kept row its own original coefficient below
        plan = hook().grpo_filter_zero_advantage(
            advantages=adv[start : start + rows], mask=mask[start : start + rows], denominator="fixed", group=None
        )
        if plan is None:  # a plugin declined: keep every row at its own coefficient
            keep, weights = torch.arange(rows), torch.ones(rows, dtype=torch.float64)
            dropped = tokens = padding = 0
        else:
            keep, weights = plan.keep.cpu(), plan.weights.cpu().to(torch.float64)
            dropped, tokens, padding = plan.rows_dropped, plan.tokens_dropped, plan.padding_rows
        coefficients = _original_coefficients(actor, mini, update.denominator)
        kept.append(keep + start)
        carriers.append(coefficients[keep] * weights)
        sizes.append(int(keep.numel()))
        update.rows_in += rows
        update.rows_kept += rows - dropped - padding
        update.tokens_dropped += tokens
        update.padding_rows += padding
    filtered = data.select_idxs(torch.cat(kept))  # shares meta_info with ``data``
    carrier = torch.cat(carriers)[:, None].expand(-1, mask.shape[-1])
    if "rollout_is_weights" in filtered.batch.keys():
        carrier = carrier * filtered.batch["rollout_is_weights"].to(torch.float64)
    filtered.batch["rollout_is_weights"] = carrier.contiguous()  # float64: divided per micro-batch
    return filtered, sizes


def _renamed_metrics(actor: Any, out: dict, update: state.ZeroAdvantageUpdate, original_micro_batches: int) -> None:
    """Metrics of a packed update: what is provably verl's keeps its name, the rest says kept_rows."""
    unchanged = list(UNCHANGED)
    pg_loss = out.get("actor/pg_loss")
    if isinstance(pg_loss, list):  # 0.6: one value per micro-batch, reduced by mean -> the same mean
        out["actor/pg_loss"] = [sum(pg_loss) / max(original_micro_batches, 1)]
    unchanged.append("actor/pg_loss")  # 0.7: a float sum over micro-batches, the same sum
    if not actor.config.use_kl_loss:
        unchanged.append("actor/kl_loss")  # 0.0 either way
    verl_metrics.rename_kept_rows(out, unchanged)


def _original_micro_batches(actor: Any, data: Any) -> int:
    """How many micro-batches unpatched verl runs for ``data`` (every epoch)."""
    config = actor.config
    count = 0
    for start in range(0, len(data), config.ppo_mini_batch_size):
        mini = data[start : start + config.ppo_mini_batch_size]
        if config.use_dynamic_bsz:
            from verl.utils.seqlen_balancing import prepare_dynamic_batch

            max_token_len = config.ppo_max_token_len_per_gpu * actor.ulysses_sequence_parallel_size
            count += len(prepare_dynamic_batch(mini, max_token_len=max_token_len)[1])
        else:
            count += -(-len(mini) // config.ppo_micro_batch_size_per_gpu)
    return count * config.ppo_epochs


def update_policy(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``DataParallelPPOActor.update_policy(data)``."""
    if instance is None or instance.actor_optimizer is None or state.update().zero_advantage is not None:
        return wrapped(*args, **kwargs)
    mode = filter_mode(instance, instance.config)
    if mode is None:
        return wrapped(*args, **kwargs)
    kind = denominator(line_of(verl_version()), effective_agg_mode(instance.config))
    update = state.ZeroAdvantageUpdate(instance, mode, kind, trim=mode == "pack" and trim_legacy.applies(instance))
    call = bind(wrapped, args, kwargs)
    data = call["data"]
    if has_multimodal_inputs(data.non_tensor_batch.get("multi_modal_inputs")):
        return wrapped(*args, **kwargs)  # per-row object arrays: not tested, never filtered
    if mode == "nograd":
        with state.in_update(zero_advantage=update):
            out = wrapped(*args, **kwargs)
    else:
        out = _packed_update(wrapped, call, instance, data, update)
    per_epoch = 1 if mode == "pack" else instance.config.ppo_epochs  # "nograd" counts every epoch's micro-batches
    verl_metrics.report(
        out,
        rows_dropped=(update.rows_in - update.rows_kept - update.padding_rows) // per_epoch,
        tokens_dropped=update.tokens_dropped // per_epoch,
        padding_rows=update.padding_rows // per_epoch,
        padding_tokens_skipped=update.padding_tokens_skipped,  # every epoch's forwards
        # every epoch's calls; "nograd" runs verl's own micro-batches (each forwarded twice): none saved
        micro_batches_dropped=update.micro_batches_unfiltered - update.micro_batches if mode == "pack" else 0,
    )
    return out


def _packed_update(wrapped: Callable[..., Any], call: Any, instance: Any, data: Any,
                   update: state.ZeroAdvantageUpdate) -> Any:
    filtered, sizes = _plan(instance, data, update)
    plan = state.SplitPlan(meta=filtered.meta_info, total=len(filtered), split_size=instance.config.ppo_mini_batch_size,
                           sizes=sizes, consumed=len(sizes) == 1)  # one mini-batch: verl's own split gives it
    original = update.micro_batches_unfiltered = _original_micro_batches(instance, data)
    with state.in_update(zero_advantage=update, split_plan=plan):
        out = call.call(wrapped, data=filtered)
    if not plan.consumed:
        raise RuntimeError(
            "grpo_patches: verl's update_policy did not split the batch into mini-batches as expected "
            "(verl internals moved?); pass zero_advantage_filter=False to grpo_patches.enable(...)"
        )
    _renamed_metrics(instance, out, update, original)
    return out


def split(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``DataProto.split(split_size)``: the planned mini-batches, once."""
    plan = state.update().split_plan
    if plan is None or plan.consumed or instance is None:
        return wrapped(*args, **kwargs)
    size = bind(wrapped, args, kwargs)["split_size"]
    if instance.meta_info is not plan.meta or len(instance) != plan.total or size != plan.split_size:
        return wrapped(*args, **kwargs)
    plan.consumed = True
    parts, start = [], 0
    for n in plan.sizes:
        parts.append(instance[start : start + n])
        start += n
    return parts


def forward_micro_batch(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``DataParallelPPOActor._forward_micro_batch(micro_batch, temperature, ...)``."""
    import torch

    update = state.update().zero_advantage
    if update is None or update.actor is not instance or not torch.is_grad_enabled():
        return wrapped(*args, **kwargs)
    call = bind(wrapped, args, kwargs)
    micro = call["micro_batch"]
    if update.mode == "pack":
        mask = micro["response_mask"]
        d = micro_denominator(mask, update.denominator)
        new = _scale(instance.config, int(mask.shape[0])) / d if d > 0 else 1.0
        micro["rollout_is_weights"] = (micro["rollout_is_weights"] / new).to(torch.float32)
        update.grad_rows += int(mask.shape[0])
        update.micro_batches += 1
        if not update.trim:
            return wrapped(*args, **kwargs)
        out, skipped = trim_legacy.forward(wrapped, call)
        update.padding_tokens_skipped += skipped
        return out
    return split_forward(wrapped, update, call)


def prepare_dynamic_batch(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """dp_actor's binding of ``prepare_dynamic_batch``: inside a packed update under data
    parallelism, every rank gets the same number of micro-batches (FSDP collectives run per
    forward). Packed mini-batches have the same row count on every rank, so the count fits."""
    update = state.update().zero_advantage
    if update is not None and update.mode == "pack" and world_size() > 1 and "dp_group" not in kwargs:
        import torch.distributed as dist

        kwargs = dict(kwargs, dp_group=dist.group.WORLD, same_micro_num_in_dp=True)
    return wrapped(*args, **kwargs)
