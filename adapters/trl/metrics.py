"""Put grpo_patches' counters into TRL's own metrics (and the status totals).

``GRPOTrainer._metrics[mode]`` maps a name to a list of values; ``GRPOTrainer.log`` averages
each list, adds it to the log row (console, wandb, tensorboard, ``state.log_history``) and
clears the lists. Everything here is written under the ``grpo_patches/`` prefix.
"""

from __future__ import annotations

from typing import Any

from grpo_patches import savings

from . import state

PREFIX = "grpo_patches/"


def mode_of(trainer: Any) -> str:
    """``"train"`` or ``"eval"``, as TRL decides it."""
    return "train" if trainer.model.training else "eval"


def _bucket(trainer: Any, mode: str | None) -> Any:
    metrics = getattr(trainer, "_metrics", None)
    if metrics is None:  # not a TRL trainer (or a future TRL without _metrics): status only
        return None
    return metrics[mode or mode_of(trainer)]


def add_count(trainer: Any, name: str, value: float = 1, mode: str | None = None) -> float:
    """Add ``value`` to a per-trainer running total and log the total as ``grpo_patches/<name>``.

    The metric's list holds that single total, so TRL's average shows the cumulative count
    since training began (in every log row of a window where the counter was touched).
    Returns the new total.
    """
    mode = mode or mode_of(trainer)
    totals = state.of(trainer).totals
    key = (mode, name)
    totals[key] = totals.get(key, 0) + value
    bucket = _bucket(trainer, mode)
    if bucket is not None:
        bucket[PREFIX + name] = [float(totals[key])]
    return totals[key]


def count_total(trainer: Any, name: str, mode: str = "train") -> float:
    """The running total of a counter kept by :func:`add_count` (0 if never touched)."""
    return state.of(trainer).totals.get((mode, name), 0)


def report(trainer: Any, **counts: float) -> None:
    """Report work saved: into ``grpo_patches.status()`` totals and TRL's metrics (cumulative).

    ``report(trainer, old_logprob_passes_skipped=1)``; zero counts are still logged, so the
    counter appears in the logs from the first event on.
    """
    nonzero = {name: value for name, value in counts.items() if value}
    if nonzero:
        savings.report("trl", **nonzero)
    for name, value in counts.items():
        add_count(trainer, name, value)
