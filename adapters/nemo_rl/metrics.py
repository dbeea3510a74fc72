"""grpo_patches in NeMo-RL's own metrics: the filter's counters, and renamed kept-rows metrics.

* :func:`report_filter_counters`: the zero-advantage filter's counters of one worker train
  call (v0.6.0+) go into the metrics ``train`` returns (``grpo_patches/<counter>``, logged by
  NeMo-RL) and into the worker's savings (v0.5.0: :mod:`.loss_call`; the driver's counter of
  skipped prev-logprob passes: :mod:`.policy_train`; placeholders kept out of the logs:
  :mod:`.honest_logs`).
* :func:`adjust_kept_rows`: the loss metrics of a micro-batch the zero-advantage filter
  reshaped (``dropped_rows_metrics=False``). NeMo-RL's ``ClippedPGLossFn`` reports means divided
  by the *global* counts, and the worker sums them over micro-batches; without the dropped rows
  each would silently become "sum over the kept rows / all rows". The shared meaning of
  ``dropped_rows_metrics`` (see :class:`grpo_patches.options.Options`) is kept instead:

* ``loss``, ``kl_penalty``, ``positive_nll_loss``: dropped rows add exactly 0 (advantage 0,
  KL penalty 0, NLL weight 0 — the filter runs only then): unchanged;
* metrics of ``prev_logprobs`` against ``generation_logprobs`` (``token_mult_prob_error``,
  ``gen_kl_error``, ``policy_kl_error``, ``js_divergence_error``, ``sampling_importance_ratio``,
  ``is_oob_ratio``) and ``num_valid_samples`` need no forward: the dropped rows' exact share is
  added by the real loss called on them (no grad) with their prev log-probs in place of the
  current ones (v0.6.0+, when prev log-probs were computed); their names stay;
* every other metric needs the dropped rows' forward: it is logged as ``<name>/kept_rows``, a
  mean over the rows that ran (rescaled from the global count to the kept count, per the
  metric's normalisation: main's ``loss_fn.metric_normalizations``, the same table for older
  tags); extrema are combined by the driver (:mod:`.policy_train`).
"""

from __future__ import annotations

from typing import Any, Callable

from . import FRAMEWORK
from .loss_modes import loss_mode
from .state import COUNTERS, METRIC_PREFIX, GlobalBatchFilter

SUFFIX = "/kept_rows"
UNCHANGED = ("loss", "kl_penalty", "positive_nll_loss")
NO_FORWARD = ("token_mult_prob_error", "gen_kl_error", "policy_kl_error", "js_divergence_error",
              "sampling_importance_ratio", "is_oob_ratio")
COUNTS = ("num_valid_samples",)
#: Normalisation of ClippedPGLossFn's metrics before main declared ``metric_normalizations``.
_TOKENS = ("probs_ratio", "probs_ratio_clamped", "token_mult_prob_error", "gen_kl_error", "policy_kl_error",
           "js_divergence_error", "approx_entropy")
_NONE = ("num_valid_samples", "positive_nll_loss", "probs_ratio_min", "probs_ratio_max", "probs_ratio_clamped_min",
         "probs_ratio_clamped_max")


def normalization(loss_fn: Any, key: str) -> str:
    """``"tokens"``, ``"sequences"`` or ``"none"``: what ``key`` was divided by."""
    declared = getattr(loss_fn, "metric_normalizations", None)
    if isinstance(declared, dict) and key in declared:
        return str(getattr(declared[key], "value", declared[key]))
    if key in _TOKENS:
        return "tokens"
    if key in _NONE:
        return "none"
    if key == "sampling_importance_ratio":
        return "sequences" if getattr(loss_fn, "sequence_level_importance_ratios", False) else "tokens"
    if key == "is_oob_ratio":
        seq_mask = getattr(loss_fn, "truncated_importance_sampling_type", None) == "seq-mask-tis"
        return "sequences" if seq_mask else "tokens"
    return "tokens" if loss_mode(loss_fn) == "TOKEN_LEVEL" else "sequences"  # NeMo-RL's own fallback


def _scale(kind: str, plan: GlobalBatchFilter, seqs: float, toks: float) -> float:
    if kind == "tokens":
        return (toks + 1e-8) / plan.kept_toks if plan.kept_toks else 0.0
    if kind == "sequences":
        return (seqs + 1e-8) / plan.kept_seqs if plan.kept_seqs else 0.0
    return 1.0


def adjust_kept_rows(metrics: dict[str, Any], loss_fn: Any, plan: GlobalBatchFilter, global_valid_seqs: Any,
           global_valid_toks: Any, prev_real: bool,
           dropped_share: Callable[[Any], dict[str, Any]] | None) -> dict[str, Any]:
    """``metrics`` of one kept micro-batch, as described in the module docstring.

    :param prev_real: ``prev_logprobs`` in the data are log-probs (not the on-policy zeros).
    :param dropped_share: the real loss's metrics of the dropped rows with their prev
        log-probs as the current ones (added once per global batch), or ``None``.
    """
    out = dict(metrics)
    exact_no_forward = prev_real and dropped_share is not None
    if not plan.seen:  # the first micro-batch of the global batch carries the dropped rows' share
        plan.seen = True
        if "num_valid_samples" in out:
            out["num_valid_samples"] = out["num_valid_samples"] + plan.dropped_seqs
        if exact_no_forward and plan.dropped is not None:
            share = dropped_share(plan.dropped)
            for key in NO_FORWARD:
                if key in out and key in share:
                    out[key] = out[key] + share[key]
    seqs, toks = float(global_valid_seqs), float(global_valid_toks)
    for key in list(out):
        exact = key in UNCHANGED or key in COUNTS or (key in NO_FORWARD and exact_no_forward)
        if exact or key.startswith("grpo_patches/"):
            continue
        value = out.pop(key)
        out[key + SUFFIX] = value * _scale(normalization(loss_fn, key), plan, seqs, toks)
    return out


def report_filter_counters(train: Any, result: Any) -> None:
    """Put a train call's counters into its returned metrics (NeMo-RL logs them) and status()."""
    counts = {name: getattr(train, name) for name in COUNTERS}
    metrics = result.get("all_mb_metrics") if isinstance(result, dict) else None
    if metrics is not None:
        for name, value in counts.items():
            metrics[METRIC_PREFIX + name] = [float(value)]
    FRAMEWORK.report_savings(**{k: v for k, v in counts.items() if v})
