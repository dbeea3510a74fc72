"""``dropped_rows_metrics=True``: the dropped rows' no-grad forward beside the kept rows' autograd one.

With the option, the zero-advantage filter (:mod:`.zero_advantage`) still gives the rows it
leaves out of the backward a forward, without gradients (no activations kept, no backward),
so that every metric TRL logs from the loss call is TRL's own, exactly; their outputs are put
back beside the kept rows' by :mod:`.policy_forward`. Under data parallelism a micro-batch
with nothing dropped still runs one (dummy) row without gradients, so that every rank runs the
same number of forwards (ZeRO-3 / FSDP gather parameters collectively inside each).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from .row_subsets import rows_of
from .state import LossCall


def forward(wrapped: Callable[..., Any], bound: Mapping[str, Any], call: LossCall, keep: Any, drop: Any) -> tuple:
    """``(logps, entropies)`` of the dropped rows ``drop`` through TRL's log-prob method
    ``wrapped`` (``bound``: its arguments for the whole micro-batch), ``(None, None)`` where
    none is run or only the dummy row; counts the rows in ``call.forward_rows``."""
    import torch

    if not call.dropped_forward or not (drop.numel() or call.always_split):
        return None, None
    rows = drop if drop.numel() else keep[:1]  # dummy row: same number of forwards on every rank
    with torch.no_grad():
        out = tuple(wrapped(**rows_of(bound, rows, row_inputs=call.row_inputs)))
    call.forward_rows += int(rows.numel())
    return (out[0], out[1]) if drop.numel() else (None, None)
