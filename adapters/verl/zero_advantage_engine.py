"""Zero-advantage filter for verl's engine workers (0.8.0-0.9.1): ``FSDPEngine.forward_backward_batch``.

``ppo_loss`` divides every agg mode by global counts (:data:`.loss_modes.DENOMINATORS`:
``"fixed"``): ``batch_num_tokens`` (the mini-batch's loss-mask tokens, all-reduced over DP at
the top of ``forward_backward_batch``), the trainer's ``global_batch_size`` and ``dp_size``.
A row's share of the loss therefore never depends on the other rows present, and dropping a
zero-advantage row is exact as long as ``batch_num_tokens`` keeps its unfiltered value.

The wrapper (training calls only) computes that value as verl does, asks the
``grpo_filter_zero_advantage`` hook which rows to keep (the same count on every DP rank), and
calls verl with the kept rows (under static batching in as few micro-batches as they fill, with
a micro-batch size of their own: :mod:`.packing_engine`) and a loss function that re-assigns the
unfiltered ``batch_num_tokens`` to each micro-batch before ``ppo_loss`` reads it. verl then
makes fewer, smaller micro-batches itself (and syncs the dynamic count over DP): dropped rows cost
no forward and no backward. The mini-batch, the optimizer step and ``global_batch_size`` are
untouched. ``grpo_patches/micro_batches_dropped`` counts the forward/backward calls saved.
"""

from __future__ import annotations

from typing import Any, Callable

from . import metrics as verl_metrics
from . import packing_engine, state
from .calls_engine import CONFIG_ATTRIBUTE, advantages_and_mask, loss_call_data, policy_update_call
from .loss_modes import effective_agg_mode
from .zero_advantage import filter_mode

#: ppo_loss metrics the filter provably leaves unchanged (``actor/pg_loss``: a SUM of global-
#: denominator terms whose dropped-row terms are exactly 0; ``kl_coef``: a constant).
UNCHANGED = ("actor/pg_loss", "kl_coef")
#: ppo_loss metrics summed over micro-batches with global denominators: the dropped rows' terms
#: are missing and the kept rows' terms are not a mean of anything, so they are not logged.
SUMS_OVER_ALL_ROWS = ("actor/entropy_loss", "kl_loss")


def batch_num_tokens_of(micro: Any) -> Any:
    """The global token count verl's ``ppo_loss`` will divide this micro-batch's loss by (the
    unfiltered one while verl runs a filtered mini-batch: ``PackedBatch.batch_num_tokens``)."""
    packed = state.update().packed
    return micro["batch_num_tokens"] if packed is None or packed.batch_num_tokens is None else packed.batch_num_tokens


def settings_problems(config: Any, data: Any) -> tuple[str, ...]:
    """Engine settings under which a row's denominator depends on its micro-batch."""
    from verl.utils import tensordict_utils as tu

    mode = effective_agg_mode(config)
    problems = []
    if mode != "token-mean" and tu.get_non_tensor_data(data=data, key="global_batch_size", default=None) is None:
        problems.append(f"loss_agg_mode={mode!r} without a global_batch_size divides by each micro-batch's rows")
    if (mode == "seq-mean-token-sum-norm" and getattr(config, "loss_scale_factor", None) is None
            and getattr(data["response_mask"], "is_nested", False)):
        problems.append("seq-mean-token-sum-norm with nested response masks and no actor.loss_scale_factor "
                        "divides by each micro-batch's longest response; set actor.loss_scale_factor")
    if int(tu.get_non_tensor_data(data=data, key="force_group_size", default=1) or 1) != 1:
        problems.append("force_group_size > 1 keeps consecutive rows in one micro-batch; the filter drops rows one by one")
    return tuple(problems)


def forward_backward_batch(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``FSDPEngine.forward_backward_batch(data, loss_function, forward_only)``."""
    import torch

    call = policy_update_call(wrapped, instance, args, kwargs)
    if call is None:
        return wrapped(*args, **kwargs)
    data, loss_function, config = call
    from verl.utils import tensordict_utils as tu

    problems = settings_problems(config, data)
    mode = filter_mode(instance, config, extra_problems=problems)
    if mode is None:
        return wrapped(*args, **kwargs)
    if mode == "nograd":
        return _nograd_update(wrapped, instance, args, kwargs)

    from grpo_patches.plugins import hook

    group = instance.get_data_parallel_group()
    total = data["loss_mask"].sum()  # the unfiltered global count, exactly as verl computes it
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM, group=group)
    batch_num_tokens = total.item()

    adv, mask = advantages_and_mask(data)
    rows = int(mask.shape[0])
    plan = hook().grpo_filter_zero_advantage(advantages=adv, mask=mask, denominator="fixed", group=group)
    if plan is None:
        return wrapped(*args, **kwargs)
    keep, size = packing_engine.packed_rows(plan.keep.cpu(), mask, data)
    padding = plan.padding_rows + int(keep.numel()) - plan.rows_kept
    dropped = rows - int(keep.numel())
    calls = [0]
    # nothing dropped: verl's own micro-batches, and no count of them (under dynamic batching the
    # count costs a planning pass and an all-reduce: only where calls were saved)
    if dropped == 0:
        output = wrapped(*args, **kwargs)
        upstream = 0
    else:
        upstream = packing_engine.micro_batch_count(instance, data)  # the calls verl would run unfiltered
        filtered = tu.index_select_tensor_dict(data, keep)
        if size is not None:
            tu.assign_non_tensor(filtered, micro_batch_size_per_gpu=size)

        def loss_with_unfiltered_tokens(*a: Any, **kw: Any) -> Any:
            calls[0] += 1
            tu.assign_non_tensor(loss_call_data(a, kw), batch_num_tokens=batch_num_tokens)
            return loss_function(*a, **kw)

        setattr(loss_with_unfiltered_tokens, CONFIG_ATTRIBUTE, config)
        with state.in_update(packed=state.PackedBatch(batch_num_tokens=batch_num_tokens)):
            output = wrapped(filtered, loss_with_unfiltered_tokens, False)  # a policy update: never forward-only
    _kept_rows_metrics(output["metrics"])
    active = (mask != 0)
    dropped_rows = torch.ones(rows, dtype=torch.bool)
    dropped_rows[keep] = False
    counts = dict(rows_dropped=dropped, tokens_dropped=int(active.cpu()[dropped_rows].sum()), padding_rows=padding,
                  micro_batches_dropped=upstream - calls[0])
    per_mini_batch = {name: [value] for name, value in counts.items()}
    verl_metrics.report(None, **counts)
    for name, value in per_mini_batch.items():
        output["metrics"][verl_metrics.PREFIX + name] = value
    return output


def _kept_rows_metrics(metrics: dict) -> None:
    """Per-micro-batch means (clip fractions, ppo_kl) say ``/kept_rows``; global-denominator
    sums that the dropped rows would have added to (entropy, KL) cannot be given: removed."""
    for name in SUMS_OVER_ALL_ROWS:
        metrics.pop(name, None)
    verl_metrics.rename_kept_rows(metrics, UNCHANGED)


def _nograd_update(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``dropped_rows_metrics=True``: verl's own micro-batches, each split into a no-grad and an
    autograd forward by :mod:`.dropped_rows_engine`; every metric stays verl's."""
    update = state.ZeroAdvantageUpdate(instance, "nograd")
    with state.in_update(zero_advantage=update):
        output = wrapped(*args, **kwargs)
    counts = dict(rows_dropped=update.rows_in - update.grad_rows, tokens_dropped=update.tokens_dropped, padding_rows=0,
                  micro_batches_dropped=0)  # verl's own micro-batches, each forwarded twice
    verl_metrics.report(None, **counts)
    for name, value in counts.items():
        output["metrics"][verl_metrics.PREFIX + name] = [value]
    return output
