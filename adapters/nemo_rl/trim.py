"""No padding work for the rows the zero-advantage filter keeps: cut a micro-batch's trailing columns.

Without sequence packing or dynamic batching, NeMo-RL hands every micro-batch of a global
batch the width the driver padded the whole batch to (``BatchedDataDict.make_microbatch_iterator``
slices rows only; the worker feeds the model ``input_ids`` with an all-ones attention mask and
``position_ids = arange(width)``); with dynamic batching, each micro-batch the width of the
longest row of its range, dropped rows included. Rows are right-padded (prompt and response
from column 0, ``input_lengths`` long), so once the filter has chosen a micro-batch's rows, the
columns after the longest of them are padding no row uses. They are cut with NeMo-RL's own
``truncate_tensors`` (what its dynamic batching does to each micro-batch), exactly:

* causal attention: no earlier column reads a later one, and the positions of the columns that
  stay are unchanged (``arange`` from 0, as before);
* the loss reads ``token_mask[:, 1:]`` (and ``sample_mask``): the cut keeps every column up to
  the last one any row's ``token_mask`` marks, as well as ``input_lengths``;
* the width stays a multiple of ``policy.make_sequence_length_divisible_by`` (tensor / context
  parallelism need it; dynamic batching: of ``dynamic_batching.sequence_length_round``, as
  NeMo-RL rounds its ranges) and never exceeds the original one (:func:`multiple_of`).

Multimodal micro-batches are left as they are (their per-image inputs are not per column). The
saving is counted as ``grpo_patches/padding_tokens_skipped`` (rows x columns cut), the name the
TRL adapter uses.
"""

from __future__ import annotations

from typing import Any

from grpo_patches.padding_columns import used_span


def multiple_of(cfg: Any, dynamic: bool) -> int:
    """What a trimmed width stays a multiple of, from the worker's policy config."""
    if dynamic:
        value = (cfg.get("dynamic_batching") or {}).get("sequence_length_round", 1)
    else:
        value = cfg.get("make_sequence_length_divisible_by", 1)
    return max(int(value or 1), 1)


def used_width(microbatch: Any) -> int:
    """The columns some row of ``microbatch`` uses: its longest input, or its last loss token."""
    width = 0
    if "input_lengths" in microbatch:
        width = int(microbatch["input_lengths"].max())
    span = used_span(microbatch["token_mask"]) if "token_mask" in microbatch else None
    if span is not None:
        width = max(width, span[1])
    return width


def _multimodal(microbatch: Any) -> bool:
    get = getattr(microbatch, "get_multimodal_dict", None)
    return bool(get is not None and get(as_tensors=False))


def trim(microbatch: Any, multiple: int = 1) -> int:
    """Cut ``microbatch``'s trailing columns that no row uses (module docstring), in place.

    :param multiple: ``policy.make_sequence_length_divisible_by``: the width kept is a multiple of it.
    :returns: the number of columns cut (0 when nothing can be cut).
    """
    if "input_lengths" not in microbatch or _multimodal(microbatch):
        return 0
    width = int(microbatch["input_ids"].shape[1])
    multiple = max(int(multiple or 1), 1)
    keep = -(-max(used_width(microbatch), 1) // multiple) * multiple
    if keep >= width:
        return 0
    microbatch.truncate_tensors(dim=1, truncated_len=keep)
    return width - keep
