"""Whether a batch really carries multimodal inputs.

verl's agent loop gives every row a ``multi_modal_inputs`` entry, an empty dict for a text-only
row (``AgentLoopWorker._compute_multi_modal_inputs``), so the key alone says nothing: a check on
the key switched the tiled loss and the filter off for every text-only batch that came through
``main_ppo``. verl's own model inputs merge the rows' dicts (``extract_multi_modal_inputs``):
only rows with a non-empty dict add anything to the forward.
"""

from __future__ import annotations

from typing import Any, Iterable


def has_multimodal_inputs(rows: Iterable[Any] | None) -> bool:
    """True when some row's ``multi_modal_inputs`` holds anything (a dict, possibly wrapped in
    tensordict's ``NonTensorData``); None, empty dicts and a missing column are text-only."""
    if rows is None:
        return False
    for row in rows:
        row = getattr(row, "data", row)  # tensordict.NonTensorData
        if row is not None and (len(row) if hasattr(row, "__len__") else True):
            return True
    return False
