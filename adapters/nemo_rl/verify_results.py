"""NeMo-RL's per-micro-batch results of an unpatched computation, fitted to what its ``train``
counts (:mod:`.verify`: a verified global batch whose patched computation was not kept)."""

from __future__ import annotations


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
