"""grpo_patches in open-instruct's own metrics: honest names for what the dropped micro-batches did not
compute, no KL metrics without a reference model, and the step's savings.

Both learners turn per-micro-batch loss statistics into metrics with
``grpo_utils.compute_metrics_from_loss_stats`` (token-weighted over the micro-batches; the
DeepSpeed driver then averages the ranks), log ``compute_vllm_local_debug_metrics`` per
micro-batch (DeepSpeed: the last one's value; OLMo-core: the mean over the step's micro-batches)
and histograms of the rho weights. With the zero-advantage filter on
(``dropped_rows_metrics=False``), a dropped micro-batch had no forward, so:

* :data:`EXACT` keep their names: the dropped micro-batches' entries are what open-instruct would
  have computed (``loss/policy_avg``, ``loss/total_avg`` and ``loss/kl_avg`` are exactly 0 on them,
  and dapo's clip fraction counts no token of advantage 0);
* every metric that needs their forward (:data:`FROM_FORWARD`, cispo's clip fraction, the debug
  metrics, the rho histogram) is computed by open-instruct's own function over the micro-batches
  with a non-zero advantage only and logged as ``<name>/kept_rows`` (NaN when there are none); the
  plain name is not logged while the filter is on, so that a dashboard never mixes the two;
* a loss statistic this module does not know (a newer open-instruct) is not logged, and
  ``status()`` says so.

At beta 0 without a reference model (``logprob_skip``) open-instruct logs ``objective/kl{0..3}_avg``
as zeros with nothing behind them: they are left out. The step's counters go in as
``grpo_patches/<name>`` (per rank; running totals in ``grpo_patches.status()``).
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import bind

from . import FRAMEWORK, steps
from .loss_modes import has_reference, loss_fn
from .state import StepState

PREFIX = "grpo_patches/"
SUFFIX = "/kept_rows"
KL_METRICS = tuple(f"objective/kl{j}_avg" for j in range(4))
#: Loss statistics the dropped micro-batches provably do not change.
EXACT = ("loss/policy_avg", "loss/total_avg", "loss/kl_avg")
#: Loss statistics that need the dropped micro-batches' forward (their ratio, rho, KL or entropy).
FROM_FORWARD = ("val/ratio", "val/ratio_var", "val/rho_clipfrac", "val/rho_weight", "val/rho_drop_frac",
                "val/rho_drop_low_frac", "val/rho_drop_high_frac", "policy/entropy_avg", *KL_METRICS)


def _renaming(step: StepState | None) -> bool:
    """Whether this step's metrics over the micro-batches that ran say ``/kept_rows``."""
    return step is not None and step.plan is not None and not FRAMEWORK.setting("dropped_rows_metrics", False)


def _useful_now(step: StepState) -> bool:
    return step.current is not None and step.plan.useful[step.current.i]


def compute_vllm_local_debug_metrics(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """The debug metrics of micro-batches with a non-zero advantage, as ``<name>/kept_rows``."""
    step = steps.active()
    if not _renaming(step):
        return wrapped(*args, **kwargs)
    if not _useful_now(step):
        return {}
    found = wrapped(*args, **kwargs)
    renamed = {name + SUFFIX: value for name, value in found.items()}
    for name, value in renamed.items():
        step.debug_sums[name] = step.debug_sums.get(name, 0.0) + value
    step.debug_count += 1
    return renamed


def accumulate_rho_histograms(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Rho histograms over the micro-batches with a non-zero advantage only."""
    step = steps.active()
    if _renaming(step) and not _useful_now(step):
        return None
    return wrapped(*args, **kwargs)


def finalize_rho_histograms(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    found = wrapped(*args, **kwargs)
    if not _renaming(steps.active()):
        return found
    return {name + SUFFIX: value for name, value in found.items()}


def record_metric(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """OLMo-core's ``record_metric``: a ``/kept_rows`` debug metric is the mean over the micro-batches that
    had their forward (``train_batch`` divides the sum by every micro-batch)."""
    step = steps.active()
    call_args = bind(wrapped, args, kwargs)
    name = call_args["name"]
    if _renaming(step) and name in step.debug_sums:
        value = step.debug_sums[name] / step.debug_count if step.debug_count else float("nan")
        return call_args.call(wrapped, value=value)
    return wrapped(*args, **kwargs)


def compute_metrics_from_loss_stats(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """The step's loss metrics: renamed where the filter left micro-batches without a forward, no KL
    metrics without a reference, the step's counters."""
    metrics = wrapped(*args, **kwargs)
    step = steps.active()
    if step is None:
        return metrics
    learner = step.learner
    if FRAMEWORK.on("logprob_skip") and not has_reference(learner) and float(learner.args.beta) == 0.0:
        for name in KL_METRICS:
            metrics.pop(name, None)
    if _renaming(step):
        metrics = _kept_rows(wrapped, bind(wrapped, args, kwargs), metrics, step)
    metrics.update({PREFIX + name: float(value) for name, value in sorted(step.counts.items())})
    metrics.update(step.verify_metrics)
    return metrics


def _kept_rows(wrapped: Callable[..., Any], call_args: Any, metrics: dict, step: StepState) -> dict:
    import torch

    exact = set(EXACT) | ({"policy/clipfrac_avg"} if loss_fn(step.learner.args) == "dapo" else set())
    from_forward = set(FROM_FORWARD) | ({"policy/clipfrac_avg"} if loss_fn(step.learner.args) != "dapo" else set())
    unknown = sorted(set(metrics) - exact - from_forward)
    if unknown:
        FRAMEWORK.note("zero_advantage_filter_metrics", f"not logged while the filter is on: {', '.join(unknown)} "
                       "(loss statistics the adapter cannot tell exact or not without the dropped micro-batches' "
                       "forward)", owner=step.learner.owner)
    useful = [i for i, u in enumerate(step.plan.useful) if u]
    stats, counts = call_args["loss_stats_B"], call_args["token_counts"]
    if useful:
        index = torch.tensor(useful, device=counts.device)
        kept = wrapped({name: values[index.to(values.device)] for name, values in stats.items()}, counts[index])
    else:
        kept = {}
    out = {name: value for name, value in metrics.items() if name in exact}
    for name in sorted(from_forward & set(metrics)):
        out[name + SUFFIX] = kept.get(name, float("nan"))
    return out
