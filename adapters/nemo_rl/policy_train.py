"""``Policy.train`` on the driver: one train call per step, checked every time.

* A step whose prev-logprob pass was skipped (:mod:`.old_logprobs`) trains only if the call
  makes exactly one optimizer step (``data.size // gbs == 1``): the skip is exact only then.
  Otherwise the pass runs here after all, before training (the weights are still the ones
  that generated the batch, so it computes what the skipped pass would have).
* For that call the loss object carries ``force_on_policy_ratio = True`` (NeMo-RL's own
  on-policy path: ratio ``exp(curr - curr.detach())``, so the gradient is exact even in a
  worker that grpo_patches does not reach) and :data:`~.state.PREV_IS_CURRENT` (a patched v0.5
  / v0.6 worker then also uses the detached current log-probs as ``prev_logprobs`` for the
  importance weights and metrics, which those versions read even under the force flag). Both
  are put back after the call; NeMo-RL pickles the loss to the workers on every call.
* NeMo-RL's logged metrics get ``grpo_patches/old_logprob_passes_skipped`` (1 when this step's
  pass was skipped, 0 when it ran; per step) and ``grpo_patches/old_logprob_rows_skipped`` (the
  rows whose pass did not run: all of them on a skipped step, the rows :mod:`.old_logprob_rows`
  needs no pass for on a deferred one). A skip is exact only through this call: another
  ``Policy`` training on the skipped step's batch (whose ``prev_logprobs`` are zeros) is an error.
* Verify mode (:mod:`.verify_driver`): on a verify step whose pass was skipped the pass runs
  for the workers to compare; their figures and switch-offs are read back from the metrics.
* The workers' own counters (``grpo_patches/*`` in ``all_mb_metrics``) stay in the metrics
  NeMo-RL logs; their running totals go to a note of this process's ``status()`` (the
  savings totals of each process count what that process saved). Metrics a v0.5 / v0.6 worker
  computed from zero ``prev_logprobs`` (it was not reached) are dropped, never logged.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from grpo_patches.call_args import bind
from grpo_patches.errors import GrpoPatchesError

from . import FRAMEWORK, PACKAGE, old_logprob_rows, verify_driver, version
from .old_logprobs import train_batch_size
from .state import COUNTERS, LOOP, METRIC_PREFIX, PREV_IS_CURRENT, PREV_MARKER, LoopCall, policy_state

#: Loss metrics ``grpo_train`` itself reads (``metrics["token_mult_prob_error"] > 1.05`` picks a plot; it
#: prints ``metrics['gen_kl_error']`` every step).
READ_BY_LOOP = ("token_mult_prob_error", "gen_kl_error")
#: Loss metrics computed from ``prev_logprobs`` (v0.5 / v0.6 read it even on the on-policy path).
PREV_METRICS = ("token_mult_prob_error", "gen_kl_error", "policy_kl_error", "js_divergence_error",
                "sampling_importance_ratio", "is_oob_ratio")


def _late_pass(loop: LoopCall, policy: Any, data: Any, steps: int) -> None:
    with FRAMEWORK.unpatched():  # NeMo-RL's own pass (Policy.get_logprobs's record would skip it again)
        data["prev_logprobs"] = policy.get_logprobs(data)["logprobs"]
    loop.prev = "late"
    FRAMEWORK.note("old_logprob_pass", f"run at train time: this train call makes {steps} optimizer steps "
                                       "(the skip is exact for one only)")


def _flag(loss_fn: Any) -> dict[str, Any]:
    """Put the on-policy flags on ``loss_fn``; returns what to restore."""
    saved = {name: loss_fn.__dict__.get(name, _ABSENT) for name in ("force_on_policy_ratio", PREV_IS_CURRENT)}
    loss_fn.force_on_policy_ratio = True
    setattr(loss_fn, PREV_IS_CURRENT, True)
    return saved


_ABSENT = object()


def _restore(loss_fn: Any, saved: dict[str, Any]) -> None:
    for name, value in saved.items():
        if value is _ABSENT:
            loss_fn.__dict__.pop(name, None)
        else:
            setattr(loss_fn, name, value)


def _reduce_kept_extrema(metrics: dict[str, list]) -> None:
    """``*_min/kept_rows`` / ``*_max/kept_rows`` over every micro-batch and worker: NeMo-RL sums
    lists of keys it does not know, so each becomes a one-element list holding its extremum."""
    for key, values in list(metrics.items()):
        if not key.endswith("/kept_rows") or not ("_min" in key or "_max" in key):
            continue
        finite = [float(v) for v in values if math.isfinite(float(v))]
        if not finite:
            metrics.pop(key)
        else:
            metrics[key] = [min(finite) if "_min" in key else max(finite)]


def _collect(policy: Any, result: Any, skipped: bool, loop: LoopCall | None) -> None:
    metrics = result.get("all_mb_metrics") if isinstance(result, dict) else None
    if metrics is None:
        return
    for key in READ_BY_LOOP:  # renamed by the filter (kept rows): the loop still needs the key, logs don't
        if loop is not None and key not in metrics and key + "/kept_rows" in metrics:
            metrics[key] = list(metrics[key + "/kept_rows"])
            loop.unlogged.add(key)
    substituted = bool(metrics.pop(PREV_MARKER, None))
    if skipped and not substituted and not version.at_least(PACKAGE, "0.7.0"):
        for key in PREV_METRICS:
            if key in READ_BY_LOOP and loop is not None and key in metrics:
                loop.unlogged.add(key)  # the loop reads it (a plot that is not drawn on zero prev anyway)
            else:
                metrics.pop(key, None)
        FRAMEWORK.note("workers", "not reached: prev-logprob metrics from zero placeholders were dropped "
                                  "(start the driver with `grpo-patches run -- ...` so workers are patched)")
    if METRIC_PREFIX + COUNTERS[0] in metrics:  # the filter ran in the workers: their status() holds their savings
        totals = policy_state(policy).worker_counters
        for name in COUNTERS:
            totals[name] = totals.get(name, 0.0) + float(sum(metrics.get(METRIC_PREFIX + name, ())))
        FRAMEWORK.note("zero_advantage_filter_workers", "the workers left out " + ", ".join(
            f"{totals[n]:g} {n.replace('_dropped', '').replace('_skipped', '').replace('_', ' ')}" for n in COUNTERS)
                       + f" so far (logged by NeMo-RL as {METRIC_PREFIX}<counter>)")
    _reduce_kept_extrema(metrics)


def _both(first: Any, second: Any) -> Any:
    def undo() -> None:
        if first is not None:
            first()
        second()

    return undo


def train(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``Policy.train(data, loss_fn, eval_mode=False, gbs=None, ...)``."""
    loop = LOOP.current()
    if loop is not None:
        loop.unlogged.clear()  # decided again for this step's metrics
    call = bind(wrapped, args, kwargs)
    if loop is not None and loop.prev in ("skipped", "deferred") and instance is not loop.policy \
            and not call["eval_mode"]:
        raise GrpoPatchesError(
            "grpo_patches skipped this step's prev-logprob pass for the Policy passed to grpo_train, but another "
            f"Policy ({type(instance).__name__}) trains on the batch: its prev_logprobs are a zero placeholder that its "
            "loss would read. Pass logprob_skip=False to grpo_patches.enable(...) (GRPO_PATCHES_OPTIONS) for this loop")
    driven = loop is not None and instance is loop.policy and not call["eval_mode"]
    step = loop.steps if driven else -1
    if driven:
        loop.steps += 1
    skipped = driven and loop.prev == "skipped"
    saved = None
    undo_verify = None
    loss_fn = call["loss_fn"]
    rows_skipped = None
    if driven and loop.prev == "deferred":
        gbs = train_batch_size(instance, call.get("gbs"))
        rows_skipped, undo_verify = old_logprob_rows.run(loop, instance, call["data"], gbs, loss_fn,
                                                         verify_driver.due(step))
        FRAMEWORK.report_savings(old_logprob_rows_skipped=rows_skipped)
    if skipped:
        data = call["data"]
        steps = int(data["input_ids"].shape[0]) // train_batch_size(instance, call.get("gbs"))
        if steps != 1:
            _late_pass(loop, instance, data, steps)
            skipped = False
        else:
            saved = _flag(loss_fn)
            rows_skipped = int(data["input_ids"].shape[0])
            FRAMEWORK.report_savings(old_logprob_passes_skipped=1, old_logprob_rows_skipped=rows_skipped)
            if verify_driver.due(step):
                force = saved["force_on_policy_ratio"]
                force = None if force is _ABSENT else force
                undo_verify = verify_driver.run_skipped_pass(instance, data, loss_fn, force)
    if driven and verify_driver.due(step):
        undo_reference = verify_driver.flag_reference(instance, loss_fn)
        if undo_reference is not None:
            undo_verify = _both(undo_verify, undo_reference)
    try:
        result = wrapped(*args, **kwargs)
    except Exception as exc:
        error = verify_driver.raised(exc)
        if error is None or error is exc:
            raise
        raise error from None
    finally:
        if saved is not None:
            _restore(loss_fn, saved)
        if undo_verify is not None:
            undo_verify()
    if driven and isinstance(result, dict) and isinstance(result.get("all_mb_metrics"), dict):
        verify_driver.collect(result["all_mb_metrics"], step)
    _collect(instance, result, skipped, loop)
    if loop is not None and instance is loop.policy and isinstance(result, dict) and "all_mb_metrics" in result:
        result["all_mb_metrics"][METRIC_PREFIX + "old_logprob_passes_skipped"] = [1.0 if skipped else 0.0]
        result["all_mb_metrics"][METRIC_PREFIX + "old_logprob_rows_skipped"] = [float(rows_skipped or 0)]
    return result
