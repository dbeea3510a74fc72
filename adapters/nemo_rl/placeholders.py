"""The placeholders a skipped pass leaves, and the guards that keep them out of every loss.

:func:`zero_logprobs`: the zeros a skipped whole pass answers with (NeMo-RL's own placeholder,
v0.7.0+: ``zeros_like``), never read by a loss on its on-policy path or at KL 0.

Rows whose prev-logprob pass the driver skipped (:mod:`.old_logprob_rows`), in the workers' loss:
their ``prev_logprobs`` are NaN and their mark (``data[MARK]``) says why:

* :data:`FIRST`: consumed by the first optimizer step of the train call, so the
  detached current log-probs are exactly what the pass would have computed;
* :data:`ZERO`: advantage exactly 0 and a loss in which nothing else reads the
  prev log-probs; the zero-advantage filter leaves such rows out, and one it keeps anyway (at
  least one row per rank, or to align ranks) gives no gradient whatever its ratio.

:func:`substitute` gives the loss the detached current log-probs in those rows. A NaN the loss
would read otherwise (a :data:`ZERO` row with a non-zero advantage) raises
:class:`~grpo_patches.errors.PlaceholderError`; so does NeMo-RL's unpatched computation on a
verify step meeting a skipped row (:func:`check_unpatched`, before it runs).

:func:`guard_skipped_pass`: a step whose whole pass was skipped (v0.7.0+: NeMo-RL's zero
placeholder in every row) gives the loss a view of its data whose ``prev_logprobs`` raise
:class:`~grpo_patches.errors.PlaceholderError` when read (the on-policy path never reads them).
"""

from __future__ import annotations

from typing import Any

from grpo_patches.errors import PlaceholderError

from . import FRAMEWORK
from .calls import loss_mask

#: Per-row mark in the train data: 0 computed, :data:`FIRST` / :data:`ZERO` skipped (NaN prev).
MARK = "grpo_patches_prev_skipped"
#: A row of the first optimizer step (its detached current log-probs are exact).
FIRST = 1.0
#: A later row with advantage exactly 0 (its prev log-probs are read by no loss term).
ZERO = 2.0

_FIX = (f"pass recompute=False to grpo_patches.enable({FRAMEWORK.name!r}, ...) (GRPO_PATCHES_OPTIONS) to run "
        "NeMo-RL's prev-logprob pass on every row")


def zero_logprobs(data: Any) -> Any:
    """The zero placeholder of a skipped pass: fp32 zeros shaped like ``data["input_ids"]``."""
    import torch

    return torch.zeros(tuple(data["input_ids"].shape), dtype=torch.float32)


def _read_rows(data: Any) -> Any:
    """Rows with at least one loss token (``token_mask[:, 1:] * sample_mask``)."""
    mask = loss_mask(data)
    return mask.reshape(mask.shape[0], -1).sum(dim=1) > 0


def substitute(data: Any, current: Any, patched: bool) -> Any:
    """``data`` with the skipped rows' ``prev_logprobs`` replaced by ``current`` (``[B, S-1]``,
    detached), a shallow copy; ``data`` itself when it has no skipped row.

    :param patched: grpo_patches' computation (``False``: a loss with no current log-probs to put
        there, or NeMo-RL's unpatched computation: ``prev_logprobs`` are read as they are, and a
        skipped row that would be read raises)."""
    import torch

    marks = data.get(MARK) if hasattr(data, "get") else None
    if marks is None:
        return data
    skipped = (marks > 0).to(data["prev_logprobs"].device)
    if not bool(skipped.any()):
        return data
    prev = data["prev_logprobs"]
    nan_read = torch.isnan(prev[:, 1:]).reshape(prev.shape[0], -1).any(dim=1) & _read_rows(data).to(prev.device)
    if not patched:
        if bool(nan_read.any()):
            raise PlaceholderError(
                f"grpo_patches: rows {torch.nonzero(nan_read).flatten().tolist()} of this micro-batch hold the NaN "
                "placeholder of a skipped prev-logprob pass, and NeMo-RL's own loss would read it; " + _FIX)
        return data
    advantages = data["advantages"][:, 1:] * data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
    nonzero = (advantages != 0).reshape(advantages.shape[0], -1).any(dim=1).to(prev.device)
    wrong = (marks.to(prev.device) == ZERO) & nonzero & _read_rows(data).to(prev.device)
    if bool(wrong.any()):
        raise PlaceholderError(
            f"grpo_patches: rows {torch.nonzero(wrong).flatten().tolist()} of this micro-batch skipped their "
            "prev-logprob pass as zero-advantage rows, but the loss reads them with a non-zero advantage (the driver "
            "and the workers disagree on the advantages); " + _FIX)
    values = torch.zeros_like(current, dtype=prev.dtype).copy_(current.detach())
    width = min(int(values.shape[1]), int(prev.shape[1]) - 1)
    new = prev.clone()
    new[skipped] = 0.0
    new[skipped, 1:1 + width] = values[skipped, :width]
    copy = type(data)(data)
    copy["prev_logprobs"] = new
    return copy


_SKIPPED_PASS = ("grpo_patches: the loss reads prev_logprobs, but the driver skipped this step's prev-logprob pass "
                 "(they are NeMo-RL's zero placeholder) and the loss is not on its on-policy path "
                 f"(force_on_policy_ratio did not reach it); pass logprob_skip=False to grpo_patches.enable("
                 f"{FRAMEWORK.name!r}, ...) (GRPO_PATCHES_OPTIONS) to run the pass")
_GUARDED: dict[type, type] = {}


def guard_skipped_pass(data: Any) -> Any:
    """A shallow copy of ``data`` whose ``prev_logprobs`` raise :class:`PlaceholderError` when read
    (``data[...]`` or ``data.get(...)``); every other key reads as in ``data``."""
    base = type(data)
    guarded = _GUARDED.get(base)
    if guarded is None:
        def __getitem__(self: Any, key: Any) -> Any:
            if key == "prev_logprobs":
                raise PlaceholderError(_SKIPPED_PASS)
            return base.__getitem__(self, key)

        def get(self: Any, key: Any, default: Any = None) -> Any:
            return self[key] if key in self else default

        guarded = _GUARDED[base] = type(f"SkippedPass{base.__name__}", (base,),
                                        {"__getitem__": __getitem__, "get": get})
    return guarded(data)


def check_unpatched(data: Any) -> None:
    """Before NeMo-RL's unpatched computation of a verify step runs on the global batch ``data``:
    a row whose pass the driver skipped would be read as NaN there (the driver runs the pass on
    every row only on its own verify steps) -- raise instead (:func:`substitute`, unpatched)."""
    if hasattr(data, "get") and data.get(MARK) is not None:
        substitute(data, None, patched=False)


def first_rows(data: Any) -> Any | None:
    """The rows marked as the first optimizer step's (``None``: no marks in ``data``)."""
    marks = data.get(MARK) if hasattr(data, "get") else None
    return None if marks is None else marks == FIRST


def dropped_marked(dropped: Any) -> bool:
    """Some of the filter's dropped rows skipped their pass (their metrics cannot come from it)."""
    marks = dropped.get(MARK) if dropped is not None and hasattr(dropped, "get") else None
    return marks is not None and bool((marks > 0).any())
