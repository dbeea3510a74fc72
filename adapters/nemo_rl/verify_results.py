"""What verify mode (:mod:`.verify`) hands back to NeMo-RL's worker ``train``: the per-micro-batch
results of an unpatched computation, fitted to what ``train`` counts (a verified global batch whose
patched computation was not kept, :func:`fit_results`), and the call's figures and switch-offs in
the metrics ``train`` returns (:func:`report_figures`, read by the driver: :mod:`.verify_driver`)."""

from __future__ import annotations

from typing import Any

from grpo_patches import verify

from .state import TrainCall

#: ``<prefix><option>`` = 1 in the metrics of a call in which verification switched ``option`` off.
SWITCHED_OFF = verify.METRIC_PREFIX + "switched_off/"


def fit_results(results: list, valid: int, slots: int | None) -> list:
    """NeMo-RL's unpatched per-micro-batch ``(loss, metrics)`` in the ``slots`` valid places its
    ``train`` expects: it counts the valid micro-batches from the call it made, the patched one.
    Fewer: padded with results it skips (no valid sample); more: the last ones merged into one
    (losses and metrics summed, ``*_min`` / ``*_max`` combined), as ``train`` and ``grpo_train``
    aggregate them anyway."""
    if slots is None:
        return results
    kept = list(results[:valid])
    if len(kept) > slots:
        tail = kept[slots - 1:]
        kept = kept[:slots - 1] + [(sum(loss for loss, _ in tail[1:]) + tail[0][0], _merged([m for _, m in tail]))]
    while len(kept) < slots:
        kept.append((kept[0][0] * 0 if kept else 0.0, {"num_valid_samples": 0}))
    return kept


def _merged(metrics: list[dict]) -> dict:
    out = dict(metrics[0])
    for more in metrics[1:]:
        for key, value in more.items():
            if key not in out:
                out[key] = value
            elif "_min" in key:
                out[key] = min(out[key], value)
            elif "_max" in key:
                out[key] = max(out[key], value)
            else:
                out[key] = out[key] + value
    return out


def report_figures(train: TrainCall, result: Any) -> None:
    """Verify mode's figures of a train call into the metrics it returns (one-element lists: the
    driver keeps the largest over the workers), and the options it switched off."""
    metrics = result.get("all_mb_metrics") if isinstance(result, dict) else None
    if metrics is None:
        return
    for key, value in train.figures.items():
        metrics[key] = [float(value)]
    for name in train.switched_off:  # this worker's status() says so already (grpo_patches.verify.check)
        metrics[SWITCHED_OFF + name] = [1.0]
