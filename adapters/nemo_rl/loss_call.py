"""``ClippedPGLossFn.__call__`` in the workers: on-policy prev log-probs, and metrics under the filter.

One record per tag line (the loss moved and changed signature):

* v0.5.0 ``loss_fn(next_token_logits, data, global_valid_seqs, global_valid_toks, ...)`` and
  v0.6.0 ``loss_fn(next_token_logprobs, data, ...)`` read ``data["prev_logprobs"]`` even under
  ``force_on_policy_ratio`` (importance weights, metrics). When the driver skipped the prev
  pass (:data:`~.state.PREV_IS_CURRENT` on the loss object), the detached current log-probs
  take their place — exactly what the skipped pass computes on-policy — and the metrics carry
  a marker so the driver knows (:mod:`.policy_train`). v0.5.0 gets logits: the current
  log-probs are taken from them without autograd (NeMo-RL's own helper for vocab-parallel
  DTensor logits).
* v0.7.0+ uses ``curr.detach()`` itself under ``force_on_policy_ratio``: nothing to substitute.
  On a step whose pass the driver skipped (:data:`~.state.PREV_IS_CURRENT`, not a verify step)
  the loss gets a view of its data whose zero placeholder raises when read
  (:func:`.placeholders.guard_skipped_pass`): the on-policy path never reads it, any other would.
* Every tag: rows whose pass the driver skipped for a multi-step batch (``recompute``,
  :mod:`.old_logprob_rows`) get the detached current log-probs (:mod:`.placeholders`).
* Verify mode (v0.6.0+): on a verified global batch whose prev-logprob pass was skipped, the
  log-probs the loss gets are measured against that pass (:func:`.verify_in_loss.measure_prev`); v0.6.0,
  when the reference pass was skipped: the loss with and without its placeholder
  (:func:`.verify_in_loss.measure_reference`).
* Under the zero-advantage filter (``dropped_rows_metrics=False``) the metrics are made honest
  by :mod:`.metrics`; on v0.5.0 the filter's counters ride on the first micro-batch's
  metrics (its worker has no other way back, see :mod:`.zero_advantage_v050`).
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import CallArgs, bind

from . import FRAMEWORK
from .metrics import adjust_kept_rows
from .placeholders import MARK, dropped_marked, guard_skipped_pass, substitute
from .state import COUNTERS, METRIC_PREFIX, PREV_IS_CURRENT, PREV_MARKER, VERIFY_PREV, GlobalBatchFilter, current_train
from .verify_in_loss import measure_prev, measure_reference


def _current_plan() -> GlobalBatchFilter | None:
    train = current_train()
    return train.current if train is not None and train.filter_on else None


def _with_prev(data: Any, current: Any) -> Any:
    """A shallow copy of ``data`` whose ``prev_logprobs`` are ``current`` (``[B, S-1]``), detached."""
    import torch

    prev = torch.zeros(data["prev_logprobs"].shape, dtype=current.dtype, device=current.device)
    prev[:, 1:] = current.detach()[:, : prev.shape[1] - 1]
    copy = type(data)(data)
    copy["prev_logprobs"] = prev
    return copy


def _current_from_logits(call: CallArgs, data: Any) -> Any | None:
    """v0.5.0: the current next-token log-probs ``[B, S-1]`` from its logits, without autograd."""
    import torch

    logits = call["next_token_logits"]
    if call.get("vocab_parallel_group") is not None:
        return None  # Megatron's vocab-parallel path: the force flag keeps the gradient exact
    with torch.no_grad():
        if isinstance(logits, torch.distributed.tensor.DTensor):
            from nemo_rl.distributed.model_utils import get_logprobs_from_vocab_parallel_logits

            return get_logprobs_from_vocab_parallel_logits(logits.float(), data["input_ids"],
                                                           seq_index=data.get("seq_index", None))
        logprobs = torch.log_softmax(logits.float()[:, :-1], dim=-1)
        return logprobs.gather(-1, data["input_ids"][:, 1:].to(logprobs.device).unsqueeze(-1)).squeeze(-1)


def _dropped_share(wrapped: Callable[..., Any], call: CallArgs) -> Callable[[Any], dict[str, Any]]:
    """v0.6.0+: the real loss's metrics of the dropped rows, their prev log-probs standing in for
    the current ones (only the metrics that need no forward are used)."""

    def share(dropped: Any) -> dict[str, Any]:
        import torch

        with torch.no_grad():
            _, metrics = wrapped(next_token_logprobs=dropped["prev_logprobs"][:, 1:].float(), data=dropped,
                                 global_valid_seqs=call["global_valid_seqs"], global_valid_toks=call["global_valid_toks"])
        return metrics

    return share


def _finish(wrapped: Callable[..., Any], instance: Any, call: CallArgs, data: Any, substituted: bool,
            share: bool) -> tuple[Any, dict[str, Any]]:
    """The loss on ``data``, its metrics made honest under the filter (module docstring)."""
    train = current_train()
    plan = train.current if train is not None and train.filter_on else None
    loss, metrics = call.call(wrapped, data=data)
    if substituted:
        metrics = {**metrics, PREV_MARKER: 1.0}
    if plan is None or not FRAMEWORK.enabled:
        return loss, metrics
    if not FRAMEWORK.on("dropped_rows_metrics"):
        prev_real = not (getattr(instance, "force_on_policy_ratio", False) or getattr(instance, PREV_IS_CURRENT, False)
                         or dropped_marked(plan.dropped))
        metrics = adjust_kept_rows(metrics, instance, plan, call["global_valid_seqs"], call["global_valid_toks"],
                                   prev_real, _dropped_share(wrapped, call) if share else None)
    if train.counters_in_loss and not plan.counters_sent:  # v0.5.0: NeMo-RL divides by the global batches
        plan.counters_sent = True
        metrics = {**metrics, **{METRIC_PREFIX + name: float(getattr(plan, name)) * plan.global_batches
                                 for name in COUNTERS}}
    return loss, metrics


def call_v050(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """v0.5.0 ``ClippedPGLossFn.__call__(next_token_logits, data, global_valid_seqs, global_valid_toks, ...)``."""
    call = bind(wrapped, args, kwargs)
    data = call["data"]
    substituted = False
    if getattr(instance, PREV_IS_CURRENT, False):
        current = _current_from_logits(call, data)
        if current is not None:
            data, substituted = _with_prev(data, current), True
    if MARK in data:  # rows whose pass the driver skipped (:mod:`.placeholders`)
        current = _current_from_logits(call, data)
        data = substitute(data, current, patched=current is not None)
    return _finish(wrapped, instance, call, data, substituted, share=False)


def call_v060(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """v0.6.0 ``ClippedPGLossFn.__call__(next_token_logprobs, data, global_valid_seqs, global_valid_toks)``."""
    call = bind(wrapped, args, kwargs)
    measure_prev(call)
    measure_reference(wrapped, call)
    data = call["data"]
    substituted = False
    if getattr(instance, PREV_IS_CURRENT, False):
        data, substituted = _with_prev(data, call["next_token_logprobs"]), True
    data = substitute(data, call["next_token_logprobs"], patched=current_train() is not None)
    return _finish(wrapped, instance, call, data, substituted, share=True)


def call_v070(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """v0.7.0+ ``ClippedPGLossFn.__call__``: its own on-policy path needs no substitution; a skipped pass's
    placeholder guarded, skipped rows substituted, filter metrics."""
    train = current_train()
    call = bind(wrapped, args, kwargs)
    if train is not None and (train.prev_diff, train.reference_diff) != (None, None):  # verify mode (:mod:`.verify`)
        measure_prev(call)
        measure_reference(wrapped, call)
    data = call["data"]
    skipped_pass = getattr(instance, PREV_IS_CURRENT, False) and getattr(instance, VERIFY_PREV, None) is None
    if skipped_pass:  # the whole pass was skipped: its zero placeholder must not be read
        data = guard_skipped_pass(data)
    if MARK in data:  # rows whose pass the driver skipped (:mod:`.placeholders`)
        data = substitute(data, call["next_token_logprobs"], patched=train is not None)
    elif _current_plan() is None and not skipped_pass:
        return wrapped(*args, **kwargs)
    if _current_plan() is None:
        return call.call(wrapped, data=data)
    return _finish(wrapped, instance, call, data, False, share=True)
