"""The micro-steps :mod:`.packing` left without a kept row: no forward, no backward.

:mod:`.packing` deals every kept row of a window into its last micro-batches; the others hold
zero-advantage rows only, whose per-token losses are exactly 0. The filter's loss wrapper
(:mod:`.zero_advantage`) asks :func:`skipped` first and answers such a micro-step with
:func:`skip`: a loss of 0 with no graph behind it (the Trainer's backward of it touches no
parameter; DDP reduces in the window's last micro-step, which always has kept rows).
"""

from __future__ import annotations

from typing import Any, Mapping

from . import FRAMEWORK, metrics, state
from .loss_modes import loss_mask

#: The ``status()`` note of packing.
NOTE = "pack_kept_rows"


def skipped(trainer: Any, inputs: Any) -> bool:
    """Whether ``inputs`` is a micro-batch packing left without kept rows (no forward, no backward)."""
    segment = getattr(FRAMEWORK.peek(trainer), "segment", None)
    return segment is not None and id(inputs) in segment.skipped


def dealt(trainer: Any, inputs: Any) -> bool:
    """Whether ``inputs`` is a micro-batch packing dealt (skipped or not)."""
    segment = getattr(FRAMEWORK.peek(trainer), "segment", None)
    return segment is not None and id(inputs) in segment.dealt


def skip(trainer: Any, inputs: Mapping[str, Any]) -> Any:
    """The loss of a skipped micro-step: 0, with no graph behind it (its rows' terms are exactly
    0); its counts go where the filter's go."""
    import torch

    call = state.LOSS.current()
    if call is not None:  # verify mode's patched computation: compared with TRL's on the same rows
        call.packed = True
    mask = loss_mask(inputs)
    rows = int(mask.shape[0])
    metrics.report(trainer, rows_dropped=rows, tokens_dropped=int(mask.sum()), forward_rows_skipped=rows,
                   micro_batches_dropped=1)
    _note(trainer)
    return torch.zeros((), device=mask.device, requires_grad=True)


def _note(trainer: Any) -> None:
    skipped_count = int(metrics.count_total(trainer, "micro_batches_dropped"))
    FRAMEWORK.note(NOTE, f"on: kept rows dealt into full micro-batches; {skipped_count} micro-batches "
                   "without a kept row skipped so far (no forward, no backward); TRL's clip fractions "
                   "(per-micro-batch means) are not logged", owner=trainer)
