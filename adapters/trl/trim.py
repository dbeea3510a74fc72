"""No padding work for the rows the zero-advantage filter keeps: trim their columns.

TRL pads a whole generation batch to one width (prompts on the left, completions on the
right) and hands every micro-batch that width. Once the filter has chosen a micro-batch's
kept rows, the policy forward (:mod:`.policy_forward`) and the deferred old-logprob pass
(:mod:`.old_logprob_rows`) run those rows on the columns some kept row attends to:

* **trailing completion padding** (columns after the last one any kept row attends to) is
  always cut. Exact under causal attention: no earlier token reads a later column, and TRL's
  loss mask (``completion_mask``, times ``tool_mask``) is 0 there. ``logits_to_keep`` shrinks
  by the same count; at least one completion column stays.
* **leading prompt padding** (columns before the first one any kept row attends to) is cut
  only where the positions stay the same. TRL passes no ``position_ids``: the model numbers
  the columns ``0..W-1`` (``arange``, in every transformers TRL 0.20 - 1.16 supports), so
  cutting ``L`` leading columns would move every kept token ``L`` positions back — equal only
  up to rounding under RoPE, different logits under absolute position embeddings. So the
  cut is made only for text decoders known to take ``position_ids`` with the arange default
  (:data:`ARANGE_POSITIONS`, by ``config.model_type``), and the model is handed the positions
  the untrimmed forward would have used, ``L..W-1`` (:class:`WithPositions`). Any other model
  (e.g. Qwen2-VL's multimodal RoPE, computed from the mask) keeps its leading columns.

Multimodal micro-batches are never trimmed (their per-image inputs and positions are cut by
TRL per row), nor the tiled loss's forward (:mod:`.tiled` computes from hidden states of its
own call), nor the no-grad forward of dropped rows with ``dropped_rows_metrics=True``. The trimmed columns' outputs are filled back to TRL's width (:func:`widen`):
log-probs with ``fill`` (the old log-probs there, so the ratio at those masked tokens is
exactly 1 and no overflow can reach a loss), entropies with 0; both are masked out of every
loss and metric. Saved work is counted as ``grpo_patches/padding_tokens_skipped`` (kept rows x
trimmed columns, summed over both passes).
"""

from __future__ import annotations

from typing import Any, Mapping

from grpo_patches.padding_columns import Columns, used_span

from .row_subsets import WithRowInputs, is_multimodal

#: ``config.model_type`` of text decoders whose forward numbers the columns ``arange(W)`` when
#: given no ``position_ids`` and uses given ones for the positions alone (checked in
#: transformers 4.53 and 5.24): leading padding may be cut with the original positions passed.
ARANGE_POSITIONS = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
    "phi3", "gpt2", "olmo2", "granite",
})


def model_type(model: Any) -> str | None:
    """``config.model_type`` of ``model`` under its DDP / accelerate wrappers (PEFT forwards it)."""
    while hasattr(model, "module"):
        model = model.module
    return getattr(getattr(model, "config", None), "model_type", None)


def columns(arguments: Mapping[str, Any]) -> Columns:
    """The leading and trailing columns no row of ``arguments`` (TRL's log-prob call, already
    cut to the kept rows) attends to, that can be cut exactly (module docstring)."""
    mask = arguments.get("attention_mask")
    multimodal = is_multimodal(arguments) or isinstance(arguments.get("model"), WithRowInputs)  # a row subset's
    span = None if mask is None or multimodal else used_span(mask)
    if span is None:
        return Columns()
    width, keep = int(mask.size(1)), int(arguments["logits_to_keep"])
    tail = min(width - span[1], keep - 1)
    lead = 0
    if model_type(arguments.get("model")) in ARANGE_POSITIONS:
        lead = min(span[0], width - keep - 1)  # the last prompt column predicts the first token
    return Columns(lead=max(lead, 0), tail=max(tail, 0))


def trimmed(arguments: Mapping[str, Any], cut: Columns) -> dict[str, Any]:
    """TRL's log-prob arguments on the kept columns (the model given the original positions)."""
    out = dict(arguments)
    if not cut.any:
        return out
    width = int(arguments["input_ids"].size(1))
    for name in ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"):
        if out.get(name) is not None:
            out[name] = out[name][:, cut.lead:width - cut.tail]
    out["logits_to_keep"] = int(arguments["logits_to_keep"]) - cut.tail
    if cut.lead:
        out["model"] = WithPositions(arguments["model"], cut.lead)
    return out


def widen(values: Any, cut: Columns, fill: Any = None) -> Any:
    """``[k, C - tail]`` outputs back to TRL's ``[k, C]``: the cut columns from ``fill``
    (``[k, C]``, e.g. the old log-probs), else 0. Leading columns are prompt columns: the
    outputs (completion columns only) never had them."""
    if values is None or not cut.tail or values.dim() < 2:
        return values
    import torch

    if fill is not None:
        rest = fill[:, values.size(1):].detach().to(device=values.device, dtype=values.dtype)
    else:
        rest = values.new_zeros((values.size(0), cut.tail, *values.shape[2:]))
    return torch.cat([values, rest], dim=1)


class WithPositions:
    """The model, given the positions the untrimmed forward numbers its columns with
    (``arange(start, start + width)``, after ``start`` leading columns were cut)."""

    def __init__(self, model: Any, start: int) -> None:
        self.model, self.start = model, start

    def __call__(self, **inputs: Any) -> Any:
        import torch

        ids = inputs["input_ids"]
        positions = torch.arange(self.start, self.start + ids.size(1), device=ids.device)
        return self.model(**inputs, position_ids=positions.unsqueeze(0))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)
