"""Logs of a step whose prev-logprob pass did not run: no zero placeholder logged as if real.

(Also: a metric ``grpo_train`` reads although the zero-advantage filter renamed it to a
kept-rows value, :data:`~.policy_train.READ_BY_LOOP`, is never logged under the all-rows name.)

When the pass is skipped (by grpo_patches, or by NeMo-RL's own ``force_on_policy_ratio``),
``train_data["prev_logprobs"]`` holds zeros and NeMo-RL fills the sequence-level log-prob
error metrics with zeros (v0.7.0+; v0.6.0 through :mod:`.old_logprobs`). Inside
``grpo_train`` these ``Logger`` methods then leave them out: the placeholder metrics, the
``prev_logprobs`` column of the step's jsonl dump, and the token-error plot (it plots prev
against generation log-probs). The loss's own ``token_mult_prob_error`` is real (the loss
compares the current log-probs with the generation ones) and stays.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import bind

from . import FRAMEWORK
from .state import LOOP

#: NeMo-RL's names of the sequence-level error metrics it fills with zeros on a skipped pass.
PLACEHOLDER_METRICS = (
    "max_seq_mult_prob_error", "mean_seq_mult_prob_error", "min_seq_mult_prob_error",
    "max_seq_mult_prob_error_after_mask", "mean_seq_mult_prob_error_after_mask",
    "min_seq_mult_prob_error_after_mask", "num_masked_seqs_by_logprob_error", "masked_correct_pct",
)


def log_metrics(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``Logger.log_metrics(metrics, step, prefix="", ...)``."""
    loop = LOOP.current()
    if loop is None:
        return wrapped(*args, **kwargs)
    call = bind(wrapped, args, kwargs)
    metrics = call["metrics"]
    drop = set(loop.unlogged)
    if loop.placeholders:
        drop.update(PLACEHOLDER_METRICS)
    if not drop & set(metrics):
        return wrapped(*args, **kwargs)
    if loop.placeholders:
        FRAMEWORK.note("placeholder_metrics", f"not logged (the prev-logprob pass did not run): "
                                              f"{', '.join(PLACEHOLDER_METRICS)}")
    return call.call(wrapped, metrics={k: v for k, v in metrics.items() if k not in drop})


def log_batched_dict_as_jsonl(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``Logger.log_batched_dict_as_jsonl(to_log, filename)``: no ``prev_logprobs`` column of zeros."""
    loop = LOOP.current()
    if loop is None or not loop.prev_is_zero:
        return wrapped(*args, **kwargs)
    call = bind(wrapped, args, kwargs)
    if "prev_logprobs" not in call["to_log"]:
        return wrapped(*args, **kwargs)
    return call.call(wrapped, to_log={k: v for k, v in call["to_log"].items() if k != "prev_logprobs"})


def log_plot_token_mult_prob_error(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``Logger.log_plot_token_mult_prob_error(data, step, name)``: not drawn from zero prev."""
    loop = LOOP.current()
    if loop is not None and loop.prev_is_zero:
        return None
    return wrapped(*args, **kwargs)
