"""Put grpo_patches' counters into TRL's own metrics (and the status totals).

``GRPOTrainer._metrics[mode]`` maps a name to a list of values; ``GRPOTrainer.log`` averages
each list, adds it to the log row (console, wandb, tensorboard, ``state.log_history``) and
clears the lists. Everything here is written under the ``grpo_patches/`` prefix, as counts per
logging step like TRL's own metrics; running totals are in ``grpo_patches.status()``.
"""

from __future__ import annotations

from typing import Any

from grpo_patches import savings

from . import state

PREFIX = "grpo_patches/"


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
    mode = mode or mode_of(trainer)
    totals = state.of(trainer).totals
    key = (mode, name)
    totals[key] = totals.get(key, 0) + value
    lists = bucket(trainer, mode) if log else None
    if lists is not None:
        step = lists.get(PREFIX + name) or [0.0]
        lists[PREFIX + name] = [float(step[-1] + value)]
    return totals[key]


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
        savings.report("trl", **nonzero)
    for name, value in counts.items():
        add_count(trainer, name, value)
