"""No padding work for the rows the zero-advantage filter keeps, on verl's legacy ``DataParallelPPOActor``.

Without remove-padding (``use_remove_padding=False``), verl 0.6.1-0.7.x hands every micro-batch
the rollout's full width ``S = P + R``: prompts left-padded to ``P`` columns, responses
right-padded to ``R``. Once the filter (:mod:`.zero_advantage_legacy`, ``"pack"``) has packed the kept
rows, the training forward (``_forward_micro_batch``) runs them on the columns some row of the
micro-batch uses (:func:`grpo_patches.padding_columns.used_span` of ``attention_mask``, and
``response_mask`` on the response columns), exactly:

* **trailing response padding** is cut: causal attention (no earlier column reads a later one),
  and verl's loss and metrics mask those response columns (``response_mask`` is 0 there for
  every row of the micro-batch). ``responses`` loses the same columns (verl slices the logits by
  its width); at least one response column stays.
* **leading prompt padding** is cut too: verl passes ``position_ids`` explicitly (its rollout's
  ``cumsum(attention_mask) - 1``), and the kept columns keep their original ``position_ids``, so
  RoPE sees the same positions; the padding columns were masked keys for every row. The last
  prompt column (it predicts the first response token) always stays.

verl's loss reads ``[rows, R]`` tensors (``old_log_probs``, ``advantages``, ``response_mask``)
from the untrimmed micro-batch, so the outputs are widened back to ``R`` (:func:`widen`):
log-probs with the old log-probs (the ratio there is exactly 1; 0 where those are a skipped
pass's placeholder, which the worker then replaces by these same values), entropies with 0; all
masked out of every loss and metric, so gradients and metrics are verl's.

Not trimmed (the forward runs as verl's): remove-padding on (verl unpads every row by
``attention_mask``: no padding is computed, nothing to cut), fused kernels (and so the tiled
loss, which describes the untrimmed positions: :mod:`.tiled_legacy`), Ulysses sequence
parallelism (needs remove-padding), ``use_prefix_grouper`` (refused by the filter), multimodal
inputs and mrope's 3-D ``position_ids``, ``dropped_rows_metrics=True`` (verl's own micro-batches),
and the no-grad old-logprob pass (``compute_log_prob``; the minimal pass of :mod:`.old_logprob_rows`
runs it on a row subset through the worker group, outside any update this module sees: trimming it
would need a worker-side record of its own, and its log-probs at padding columns go back to the
trainer).

The engine line (0.8.0-0.9.x, :mod:`.zero_advantage_engine`) needs no trim: its micro-batches are nested
(jagged) tensors, one row each of exactly its own tokens; without remove-padding the FSDP engine
pads each micro-batch to its own longest row (``torch.nested.to_padded_tensor`` in
``prepare_model_inputs``, right padding only, ``pad_mode`` is always ``no_padding``), so the
micro-batches the filter builds from kept rows already have no column no kept row uses.

Saved work: ``grpo_patches/padding_tokens_skipped`` (rows x columns cut), as in the TRL and
NeMo-RL adapters.
"""

from __future__ import annotations

from typing import Any

from grpo_patches.call_args import CallArgs
from grpo_patches.padding_columns import Columns, used_span

#: the tensors of a legacy micro-batch that ``_forward_micro_batch`` reads per column
_SEQUENCE_KEYS = ("input_ids", "attention_mask", "position_ids")


def applies(actor: Any) -> bool:
    """Whether ``actor``'s training forward is verl's plain padded one (module docstring)."""
    return not (actor.use_remove_padding or getattr(actor, "use_fused_kernels", False)
                or getattr(actor, "use_prefix_grouper", False)
                or int(getattr(actor, "ulysses_sequence_parallel_size", 1) or 1) > 1)


def columns(micro: dict) -> Columns:
    """The leading prompt and trailing response columns no row of ``micro`` uses (module docstring)."""
    import torch

    if "multi_modal_inputs" in micro or any(not isinstance(micro.get(k), torch.Tensor) for k in _SEQUENCE_KEYS):
        return Columns()
    if micro["position_ids"].dim() != 2:  # mrope (bsz, 4, seqlen)
        return Columns()
    attention, responses = micro["attention_mask"], micro["responses"]
    width, response = int(attention.shape[1]), int(responses.shape[1])
    response_mask = micro.get("response_mask")
    if response_mask is not None:  # a loss column always counts as used
        response_mask = torch.nn.functional.pad(response_mask, (width - response, 0))
    span = used_span(attention, response_mask)
    if span is None:
        return Columns()
    lead = min(span[0], width - response - 1)  # the last prompt column predicts response token 0
    tail = min(width - span[1], response - 1)
    return Columns(lead=max(lead, 0), tail=max(tail, 0))


def trimmed(micro: dict, cut: Columns) -> dict:
    """A copy of ``micro`` whose sequence tensors (and ``responses``) hold the kept columns only."""
    out = dict(micro)
    width = int(micro["input_ids"].shape[1])
    for key in _SEQUENCE_KEYS:
        out[key] = micro[key][:, cut.lead : width - cut.tail]
    response = int(micro["responses"].shape[1])
    out["responses"] = micro["responses"][:, : response - cut.tail]
    return out


def widen(values: Any, cut: Columns, fill: Any = None) -> Any:
    """``[rows, R - tail]`` outputs back to verl's ``[rows, R]``: the cut columns from ``fill``
    (``[rows, R]``; its non-finite entries as 0), else 0."""
    import torch

    if values is None or not cut.tail or not isinstance(values, torch.Tensor) or values.dim() < 2:
        return values
    if fill is not None:
        rest = fill[:, values.size(1):].detach().to(device=values.device, dtype=values.dtype)
        rest = torch.where(torch.isfinite(rest), rest, torch.zeros_like(rest))
    else:
        rest = values.new_zeros((values.size(0), cut.tail, *values.shape[2:]))
    return torch.cat([values, rest], dim=1)


def forward(wrapped: Any, call: CallArgs) -> tuple[Any, int]:
    """``_forward_micro_batch`` (``call``: its arguments) on the micro-batch's used columns, outputs
    widened back to verl's width.

    :returns: verl's outputs and the token positions not computed (rows x columns cut).
    """
    micro = call["micro_batch"]
    cut = columns(micro)
    if not cut.any:
        return call.call(wrapped), 0
    out = call.call(wrapped, micro_batch=trimmed(micro, cut))
    old = micro.get("old_log_probs")
    if isinstance(out, dict):  # 0.7: {"log_probs", "entropys", ...}
        out = {k: widen(v, cut, old if k == "log_probs" else None) for k, v in out.items()}
    else:  # 0.6: (entropy, log_probs)
        out = tuple(widen(v, cut, old if i == len(out) - 1 else None) for i, v in enumerate(out))
    return out, cut.tokens(int(micro["input_ids"].shape[0]))
