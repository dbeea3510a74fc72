"""The running totals of work saved, per framework, that ``status()`` shows.

Written by the default ``grpo_report_savings`` observer (:mod:`grpo_patches.defaults`); kept
apart from :mod:`grpo_patches.savings` (which calls the hook) so that the plugin manager, the
defaults and the reporting API import each other in one direction only.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Mapping

_lock = threading.Lock()
_totals: dict[str, dict[str, float]] = defaultdict(dict)


def add_to_totals(framework: str, savings: Mapping[str, float]) -> None:
    """Default observer: accumulate into the per-framework totals."""
    with _lock:
        bucket = _totals[framework]
        for name, value in savings.items():
            bucket[name] = bucket.get(name, 0) + value


def totals(framework: str) -> dict[str, float]:
    """A copy of the totals reported so far for ``framework``."""
    with _lock:
        return dict(_totals.get(framework, {}))


def reset(framework: str | None = None) -> None:
    """Forget the totals (of one framework, or all)."""
    with _lock:
        if framework is None:
            _totals.clear()
        else:
            _totals.pop(framework, None)
