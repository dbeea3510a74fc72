"""The placeholder of the deferred old-logprob pass, and the guard that keeps it out of every loss.

The deferred pass (:mod:`.old_logprob_rows`) computes old log-probs only for the rows the
zero-advantage filter keeps; the rows it leaves out hold a placeholder in
``old_per_token_logps``. The placeholder is NaN, never a plausible number, so that it cannot be
mistaken for a value. Before TRL's loss reads the old log-probs, :func:`guard` replaces it with 0
where no gradient can come of it:

* rows the filter leaves out of this loss call: their current log-probs are filled with the
  same value, so their ratio is exactly 1 (:mod:`.policy_forward`);
* rows whose advantage is exactly 0 (kept to align data-parallel ranks): their per-token loss
  is 0 with any finite ratio.

A row the loss would read with a non-zero advantage raises :class:`PlaceholderError`: the
filter's decision at generation and in the loss differ, and the loss would be wrong.
"""

from __future__ import annotations

from typing import Any, Mapping

from grpo_patches.errors import PlaceholderError

KEY = "old_per_token_logps"


def new(rows: int, width: int, device: Any) -> Any:
    """A ``[rows, width]`` placeholder: NaN everywhere until the kept rows are filled in."""
    import torch

    return torch.full((rows, width), float("nan"), device=device)


def guard(inputs: Mapping[str, Any], read: Any = None, strict: bool = True) -> Mapping[str, Any]:
    """``inputs`` with the placeholders the loss may meet replaced by 0 (``inputs`` itself when
    there are none; never modified in place).

    :param read: the rows the loss reads with gradients (a LongTensor; ``None``: every row).
    :param strict: raise for a placeholder in a row read with a non-zero advantage; ``False``
        leaves such rows as they are (an inner wrapper that knows the rows read judges them).
    :raises PlaceholderError: a placeholder in a row the loss reads with a non-zero advantage.
    """
    import torch

    old = inputs.get(KEY)
    if old is None:
        return inputs
    held = torch.isnan(old).reshape(old.size(0), -1).any(dim=1)
    if not bool(held.any()):
        return inputs
    advantages = inputs["advantages"]
    nonzero = (advantages.reshape(advantages.size(0), -1) != 0).any(dim=1).to(held.device)
    reading = torch.ones_like(held)
    if read is not None:
        reading = torch.zeros_like(held).index_fill(0, read.to(held.device), True)
    wrong = held & nonzero & reading
    if strict and bool(wrong.any()):
        rows = torch.nonzero(wrong).flatten().tolist()
        raise PlaceholderError(
            f"grpo_patches: the old log-probs of row(s) {rows} of this micro-batch are placeholders (NaN) of the "
            "old-logprob pass deferred to the rows the zero-advantage filter keeps, but TRL's loss reads them with "
            "a non-zero advantage: the filter's decision when the rollout was scored and in the loss differ (a "
            "grpo_filter_zero_advantage plugin whose answer depends on more than the advantages?). The loss would "
            "be wrong, so nothing was computed. Fix the plugin, or pass dropped_rows_metrics=True (no deferral) or "
            "zero_advantage_filter=False to grpo_patches.enable('trl', ...)"
        )
    replace = held & ~(nonzero & reading)
    if not bool(replace.any()):
        return inputs
    return {**inputs, KEY: old.masked_fill(replace.reshape(-1, *([1] * (old.dim() - 1))), 0.0)}

