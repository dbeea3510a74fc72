"""grpo_patches' counters and the filter's renamed metrics, in TRL's own metrics.

``GRPOTrainer._metrics[mode]`` maps a name to a list of values; ``GRPOTrainer.log`` averages
each list, adds it to the log row (console, wandb, tensorboard, ``state.log_history``) and
clears the lists.

**Counters** (:func:`report`, :func:`add_count`) are written under the ``grpo_patches/``
prefix, as counts per logging step like TRL's own metrics; running totals are in
``grpo_patches.status()``.

**TRL's loss metrics when the dropped rows had no forward** (``dropped_rows_metrics=False``,
:func:`relabel`). The filter hands TRL's ``_compute_loss`` the whole ``[B, T]`` micro-batch
with the dropped rows' values filled in (:mod:`.policy_forward`). Every metric TRL logs from
it falls in one class:

* :data:`EXACT`: the dropped rows provably do not change it. TRL's clip fractions count a
  token only when its advantage has the clipped side's sign (``advantages < 0`` for the low
  clip, ``> 0`` for the high clip, ``> 0`` for CISPO's), over denominators from the mask
  alone; a row with advantage exactly 0 is never counted, whatever its ratio. True for
  GRPOTrainer 0.20 - 1.16 and GMPOTrainer (whose clip test is the same in log space).
* :data:`FROM_FORWARD`: it needs the dropped rows' forward. It is logged as
  ``<name>/kept_rows`` instead, over the rows with a non-zero advantage (the rows the
  filter keeps for their gradient; rows kept only to align data-parallel ranks are left
  out): ``entropy/kept_rows`` is the token mean of the entropy over those rows' unmasked
  tokens on every process; ``vespo/phi_seq_mean/kept_rows`` the mean of VESPO's sequence
  weight over those rows. NaN (skipped by TRL's averaging) when no such row exists.
* anything else: a metric this module does not know (a setting the filter allows in a TRL
  it does not know). It is not logged, and the reason is in ``status()``: never a value
  computed from filled-in rows.

KL, the policy loss, the entropy coefficient and the MoE aux loss are only logged with
settings that switch the filter off.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping

from . import FRAMEWORK, state

PREFIX = "grpo_patches/"
#: Metrics the dropped rows provably do not change (module docstring).
EXACT = frozenset({
    "clip_ratio/low_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_mean",
    "clip_ratio/high_max",
    "clip_ratio/region_mean",
    "cispo_clip_ratio",
})
#: Metrics that need the dropped rows' forward, logged over the kept rows instead.
FROM_FORWARD = ("entropy", "vespo/phi_seq_mean")
SUFFIX = "/kept_rows"


def mode_of(trainer: Any) -> str:
    """``"train"`` or ``"eval"``, as TRL decides it."""
    return "train" if trainer.model.training else "eval"


def bucket(trainer: Any, mode: str | None = None) -> Any:
    """TRL's metric lists for ``mode`` (default: the trainer's current mode), or ``None``."""
    metrics = getattr(trainer, "_metrics", None)
    if metrics is None:  # not a TRL trainer (or a future TRL without _metrics): status only
        return None
    return metrics[mode or mode_of(trainer)]


def add_count(trainer: Any, name: str, value: float = 1, mode: str | None = None, log: bool = True) -> float:
    """Add ``value`` to this logging step's ``grpo_patches/<name>`` and to a per-trainer total.

    The metric's list holds one number, the sum since TRL's last log row (``log`` clears the
    lists), so each log row shows that logging step's count, like TRL's own metrics. The
    running total stays on the trainer (:func:`count_total`) and in ``grpo_patches.status()``.
    ``log=False`` keeps the total only. Returns the new total.
    """
    return _add_counts(trainer, {name: value}, mode, log)[name]


def _add_counts(trainer: Any, counts: Mapping[str, float], mode: str | None = None,
                log: bool = True) -> dict[str, float]:
    """:func:`add_count` for several counters at once; their new totals."""
    mode = mode or mode_of(trainer)
    totals = state.of(trainer).totals
    lists = bucket(trainer, mode) if log else None
    for name, value in counts.items():
        key = (mode, name)
        totals[key] = totals.get(key, 0) + value
        if lists is not None:
            step = lists.get(PREFIX + name) or [0.0]
            lists[PREFIX + name] = [float(step[-1] + value)]
    return {name: totals[(mode, name)] for name in counts}


def count_total(trainer: Any, name: str, mode: str = "train") -> float:
    """The running total of a counter kept by :func:`add_count` (0 if never touched)."""
    return state.of(trainer).totals.get((mode, name), 0)


def report(trainer: Any, **counts: float) -> None:
    """Report work saved: into ``grpo_patches.status()`` totals and TRL's metrics (per logging step).

    ``report(trainer, old_logprob_passes_skipped=1)``; zero counts are still logged, so the
    counter appears in every log row from the first event on.
    """
    nonzero = {name: value for name, value in counts.items() if value}
    if nonzero:
        FRAMEWORK.report_savings(**nonzero)
    _add_counts(trainer, counts)


# ---------------------------------------------------------------------------------------
# metrics of a filtered loss call, over the kept rows


def _global_mean(trainer: Any, total: Any, count: Any) -> float:
    """``sum(total) / sum(count)`` over the data-parallel processes; NaN for an empty set."""
    import torch

    both = trainer.accelerator.reduce(torch.stack([total.detach().float(), count.detach().float()]), reduction="sum")
    return float(both[0] / both[1]) if float(both[1]) > 0 else math.nan


def entropy_over(trainer: Any, entropies: Any, mask: Any, rows: Any) -> float:
    """Token mean of ``entropies`` over the unmasked tokens of ``rows``, on every process."""
    weights = mask[rows].float()
    return _global_mean(trainer, (entropies[rows].float() * weights).sum(), weights.sum())


def row_mean_over(trainer: Any, values: Any, rows: Any) -> float:
    """Mean of a ``[B, 1]`` per-row value over ``rows``, on every process."""
    picked = values[rows].float()
    return _global_mean(trainer, picked.sum(), picked.new_tensor(float(picked.numel())))


@contextmanager
def captured_gamma_weights(trainer: Any) -> Iterator[dict[str, Any]]:
    """Capture VESPO's per-row weights as TRL computes them in this ``_compute_loss`` call
    (``self.get_gamma_weights`` is looked up on the instance first)."""
    seen: dict[str, Any] = {}
    original = getattr(type(trainer), "get_gamma_weights", None)
    if original is None:  # a TRL without VESPO
        yield seen
        return

    def capture(*args: Any, **kwargs: Any) -> Any:
        seen["phi"] = original(*args, **kwargs)
        return seen["phi"]

    trainer.__dict__["get_gamma_weights"] = capture
    try:
        yield seen
    finally:
        trainer.__dict__.pop("get_gamma_weights", None)


def snapshot(bucket: Mapping[str, list]) -> dict[str, int]:
    """How many values each metric list holds before a loss call."""
    return {name: len(values) for name, values in bucket.items()}


def relabel(trainer: Any, bucket: dict[str, list], before: Mapping[str, int],
            kept_value: Callable[[str], float | None], packed: bool = False) -> None:
    """Rewrite the metrics TRL appended during one filtered loss call (module docstring).

    :param kept_value: the kept-rows value of a :data:`FROM_FORWARD` metric (``None`` when it
        cannot be computed: the metric is then dropped, with a note).
    :param packed: the micro-batch was dealt by :mod:`.packing`: the :data:`EXACT` metrics are
        per-micro-batch means over other micro-batches than TRL's, so they are dropped too.
    """
    for name in list(bucket):
        if name.startswith("grpo_patches/") or name.endswith(SUFFIX):
            continue
        new = bucket[name][before.get(name, 0):]
        if not new or (name in EXACT and not packed):
            continue
        del bucket[name][before.get(name, 0):]
        if not bucket[name] and name not in before:
            del bucket[name]
        value = kept_value(name) if name in FROM_FORWARD else None
        if value is not None:
            if not math.isnan(value):  # NaN: no kept row on any process in this call, nothing to log
                bucket.setdefault(name + SUFFIX, []).append(value)
        elif name in EXACT:
            FRAMEWORK.note(f"metric {name}", "not logged: a per-micro-batch mean, and pack_kept_rows deals the "
                           "rows into other micro-batches; pack_kept_rows=False logs it", owner=trainer)
        else:
            FRAMEWORK.note(f"metric {name}", "not logged: it needs the dropped rows' forward; "
                           "grpo_patches.enable('trl', dropped_rows_metrics=True) logs it", owner=trainer)


# ---------------------------------------------------------------------------------------
# verify mode's figures


def record_verify(trainer: Any, figures: Mapping[str, float]) -> None:
    """Verify mode's figures (``grpo_patches/verify/<quantity>``) into TRL's training metrics:
    the largest of the logging step (a difference is judged by its worst case, not its mean).
    They appear only in the log rows of steps that were verified."""
    lists = bucket(trainer, "train")
    if lists is None:
        return
    for name, value in figures.items():
        earlier = lists.get(name)
        lists[name] = [float(value) if not earlier else max(earlier[0], float(value))]
