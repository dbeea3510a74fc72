"""The old-logprob pass on on-policy updates, worker side of verl's engine (0.8.0-0.9.1).

The engine's ``ppo_loss`` always reads ``old_log_probs``. When the trainer skipped their pass
(:mod:`.old_logprobs`), the worker receives them as the placeholder (:mod:`.placeholders`) on
every token, whichever trainer (V1 with TransferQueue, or the legacy one) carried them; the
update is one mini-batch and one epoch, so the first and only forward runs on the weights the pass would
have used: the loss gets ``old_log_prob = log_prob.detach()`` (what the legacy actor does
on-policy). Not bitwise: verl's own pass recomputes the log-probs in a separate forward
(eval mode, its own micro-batches), equal to the training forward's up to floating-point
noise, so the ratio is exactly 1 here and ``1 +- 1e-7`` there.

* ``TrainingWorker.train_mini_batch`` (wrapped): on old log-probs that are all placeholder,
  checks the promise (one mini-batch of this rank's rows, ``epochs == 1``; else a clear error,
  and a batch only partly placeholder is one too), asks the forward for entropies
  (``calculate_entropy``), and logs ``actor/entropy`` (which the trainer computes from the
  skipped pass) from the training forward's entropies, aggregated over the whole batch and
  all data-parallel ranks exactly as the trainer does. With the zero-advantage filter
  dropping rows it is over the kept rows: ``actor/entropy/kept_rows``, and no ``actor/entropy``.
  The update reports ``grpo_patches/old_log_probs_substituted`` in verl's metrics: the trainer
  stops the run when an update after a skipped pass does not (:mod:`.skip_guarantee`).
* ``FSDPEngineWithLMHead.forward_step`` (wrapped; on the Megatron engine its
  ``forward_backward_batch``: :mod:`.old_logprobs_megatron`): collects each micro-batch's entropies.
* ``get_policy_loss_fn`` (``verl.workers.utils.losses``' binding): ``old_log_prob`` is the
  detached ``log_prob``.

The update's :class:`~.state.OnPolicyUpdate` is ``UpdateCall.on_policy`` (:mod:`.state`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from grpo_patches.call_args import bind

from . import metrics as verl_metrics
from . import placeholders, state, verify_old_logprobs
from .calls_engine import CONFIG_ATTRIBUTE, actor_config_of, loss_call_data
from .skip_guarantee import SUBSTITUTED


def train_mini_batch(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``TrainingWorker.train_mini_batch(data)``."""
    data = bind(wrapped, args, kwargs)["data"] if instance is not None else None
    if data is None or "old_log_probs" not in data.keys() \
            or not placeholders.present(data["old_log_probs"]):
        return wrapped(*args, **kwargs)
    from verl.utils import tensordict_utils as tu

    rows = int(data.shape[0])
    mini = tu.get_non_tensor_data(data=data, key="mini_batch_size", default=None)
    num_mini = tu.get_non_tensor_data(data=data, key="num_mini_batch", default=None)
    epochs = int(tu.get_non_tensor_data(data=data, key="epochs", default=1))
    per_rank = mini // instance.engine.get_data_parallel_size() if mini is not None else rows // max(int(num_mini), 1)
    complete = placeholders.fills(data["old_log_probs"])
    if not complete or -(-rows // max(per_rank, 1)) != 1 or epochs != 1:
        raise placeholders.PlaceholderError(
            f"grpo_patches: the old-logprob pass was skipped but this update is not on-policy ({rows} rows on this rank, "
            f"{per_rank} per mini-batch, {epochs} epochs, old log-probs all placeholder: {complete}); nothing was "
            f"trained. Please report this and {placeholders.FIX}"
        )
    update = state.OnPolicyUpdate()
    if not tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False):
        tu.assign_non_tensor(data, calculate_entropy=True)  # the entropies the skipped pass would have given
        update.forced_entropy = True
    with state.in_update(on_policy=update):
        output = wrapped(*args, **kwargs)
    if output is not None:
        metrics = tu.get(output, "metrics")
        if update.forced_entropy:
            metrics.pop("actor/entropy_loss", None)  # verl logs it only when asked for entropies
        _log_entropy(metrics, instance, update, rows)
        metrics[SUBSTITUTED] = [1.0]  # the trainer checks that the update after a skipped pass says so
    verl_metrics.report(None, old_logprob_substituted_updates=1)
    return output


def forward_step(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``FSDPEngineWithLMHead.forward_step(micro_batch, loss_function, forward_only)``:
    keep each training micro-batch's entropies."""
    return collecting_entropies(wrapped, args, kwargs)


def collecting_entropies(wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``wrapped`` (``loss_function``, ``forward_only`` among its parameters) with a loss function that
    keeps each training micro-batch's entropies for ``actor/entropy`` (and, on a verify step, hands the
    loss the pass's old log-probs of that micro-batch)."""
    update = state.update().on_policy
    if update is None:
        return wrapped(*args, **kwargs)
    call = bind(wrapped, args, kwargs)
    loss_function = call["loss_function"]
    if call["forward_only"] or loss_function is None:
        return wrapped(*args, **kwargs)

    def collecting(*a: Any, **kw: Any) -> Any:
        from verl.workers.utils.padding import no_padding_2_padding

        model_output = kw["model_output"] if "model_output" in kw else a[0]
        data = loss_call_data(a, kw)
        entropy = model_output.get("entropy")
        if entropy is not None:
            mask = data.select("response_mask").to_padded_tensor()["response_mask"]
            update.entropy.append((no_padding_2_padding(entropy, data).detach().float(), mask))
            update.rows_seen += int(mask.shape[0])
        with state.in_micro_batch(pass_old_log_probs=verify_old_logprobs.expected(data)):  # for _on_policy_loss
            return loss_function(*a, **kw)

    config = actor_config_of(loss_function)
    if config is not None:
        setattr(collecting, CONFIG_ATTRIBUTE, config)
    return call.call(wrapped, loss_function=collecting)


def get_policy_loss_fn(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``get_policy_loss_fn`` as ``ppo_loss`` calls it: old := detached current log-probs."""
    fn = wrapped(*args, **kwargs)
    if state.update().on_policy is None:
        return fn
    return functools.partial(_on_policy_loss, fn)


def _on_policy_loss(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    kwargs["old_log_prob"] = kwargs["log_prob"].detach()
    verify_old_logprobs.used(kwargs["old_log_prob"], kwargs["response_mask"])  # a verify step compares it with the pass
    return fn(*args, **kwargs)


def _log_entropy(metrics: dict, worker: Any, update: state.OnPolicyUpdate, rows: int) -> None:
    """``actor/entropy`` as the trainer computes it from the pass: ``agg_loss`` over every row of every rank."""
    import torch
    import torch.distributed as dist
    from verl.trainer.ppo.core_algos import agg_loss

    if not update.entropy:
        return
    width = max(e.shape[-1] for e, _ in update.entropy)

    def padded(t: Any) -> Any:
        return torch.nn.functional.pad(t, (0, width - t.shape[-1]))

    entropy = torch.cat([padded(e) for e, _ in update.entropy])
    mask = torch.cat([padded(m.to(entropy.dtype)) for _, m in update.entropy])
    complete = update.rows_seen == rows
    group = worker.engine.get_data_parallel_group()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        entropy, mask = verl_metrics.gather_rows(entropy, group), verl_metrics.gather_rows(mask, group)
        flag = torch.tensor([int(complete)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        complete = bool(flag.item())
    config = worker.loss_fn.keywords.get("config") if isinstance(worker.loss_fn, functools.partial) else None
    mode = config.loss_agg_mode if config is not None else "token-mean"
    scale = config.loss_scale_factor if config is not None else None
    value = agg_loss(loss_mat=entropy, loss_mask=mask, loss_agg_mode=mode, loss_scale_factor=scale).item()
    name = "actor/entropy" if complete else "actor/entropy" + verl_metrics.KEPT_ROWS
    metrics[name] = [value]
