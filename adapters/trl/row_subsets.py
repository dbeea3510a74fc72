"""The arguments of TRL's log-prob method for a subset of a micro-batch's rows.

Text arguments (:data:`ROW_ARGS`) are sliced. Multimodal ones (:data:`MULTIMODAL_KEYS`) are
indexed per image / tile, not per row, so the adapter lets TRL cut them:
``GRPOTrainer._get_per_token_logps_and_entropies(model, ...)`` cuts a micro-batch into chunks
of rows, builds each chunk's model inputs (multimodal tensors cut the way that TRL version and
model need) and calls ``model(**inputs, labels=..., fused_lm_head=True)``. Handing it a
stand-in for ``model``:

* :class:`RowRecorder` (no forward at all): each row's multimodal model inputs, cut by TRL
  (called with ``batch_size=1``), so any subset of rows can be assembled (:func:`per_row_inputs`);
* :class:`WithRowInputs`: the real model, given the multimodal inputs of the rows TRL's
  text-only call is processing (a row subset of a multimodal micro-batch).

Instruments that count forwards skip a stand-in marked ``runs_no_forward``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Mapping

#: Per-row arguments of ``_get_per_token_logps_and_entropies`` that are sliced with the rows.
ROW_ARGS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")
#: Multimodal arguments, indexed per image / tile (not per row): a row subset takes its rows'
#: model inputs as TRL cuts them.
MULTIMODAL_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "image_sizes",
    "spatial_shapes",
    "num_tiles",
    "image_position_ids",
)
#: Model inputs TRL builds from the text arguments (the rest are multimodal, cut per row by TRL).
TEXT_INPUTS = ("input_ids", "attention_mask", "output_router_logits")


def is_multimodal(arguments: Mapping[str, Any]) -> bool:
    return any(arguments.get(name) is not None for name in MULTIMODAL_KEYS)


def rows_of(bound: Mapping[str, Any], rows: Any, method: Callable[..., Any] | None = None,
            row_inputs: list | None = None) -> dict[str, Any]:
    """The arguments of ``_get_per_token_logps_and_entropies`` for a subset of rows.

    Multimodal arguments are not cut here: each row's model inputs are recorded once through
    TRL's own ``method`` (or given as ``row_inputs``) and handed to the model with its rows.
    """
    out = dict(bound)
    for name in ROW_ARGS:
        if out.get(name) is not None:
            out[name] = out[name].index_select(0, rows)
    if is_multimodal(bound):
        if row_inputs is None:
            row_inputs = per_row_inputs(method, bound)
        out.update(dict.fromkeys(MULTIMODAL_KEYS))
        out["model"] = WithRowInputs(bound["model"], [row_inputs[i] for i in rows.tolist()])
    return out


class RowRecorder:
    """Records the multimodal model inputs of every call (one row each with ``batch_size=1``)."""

    runs_no_forward = True

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def __call__(self, *, labels: Any = None, fused_lm_head: bool = False, **inputs: Any) -> Any:
        import torch

        self.rows.append({key: value for key, value in inputs.items() if key not in TEXT_INPUTS})
        ids = inputs["input_ids"]
        zeros = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)
        return SimpleNamespace(log_probs=zeros, entropy=zeros, aux_loss=zeros.sum(), logits=None)


def per_row_inputs(method: Callable[..., Any], arguments: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Each row's multimodal model inputs, as TRL's log-prob ``method`` cuts them."""
    import torch

    recorder = RowRecorder()
    with torch.no_grad():
        method(**{**arguments, "model": recorder, "batch_size": 1, "compute_entropy": False,
                  "compute_aux_loss": False})
    return recorder.rows


class WithRowInputs:
    """The model, given the multimodal inputs of the rows each (text-only) call processes."""

    def __init__(self, model: Any, rows: list[dict[str, Any]]) -> None:
        self.model, self.rows, self.done = model, rows, 0

    def __call__(self, **inputs: Any) -> Any:
        import torch

        count = int(inputs["input_ids"].size(0))
        chunk, self.done = self.rows[self.done:self.done + count], self.done + count
        for key in chunk[0] if chunk else ():
            values = [row[key] for row in chunk]
            inputs[key] = torch.cat(values) if isinstance(values[0], torch.Tensor) else values
        return self.model(**inputs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)
