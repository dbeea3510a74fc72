"""Stand-ins for the model in TRL's own log-prob method, so the adapter reuses TRL's input handling.

``GRPOTrainer._get_per_token_logps_and_entropies(model, ...)`` cuts a micro-batch into chunks
of rows, builds each chunk's model inputs (multimodal tensors cut per image / tile the way
that TRL version and model need), asks MoE models for their aux loss, and calls
``model(**inputs, labels=..., fused_lm_head=True)``. Handing it a stand-in for ``model``:

* :class:`RowRecorder` (no forward at all): each row's multimodal model inputs, cut by TRL
  (called with ``batch_size=1``), so any subset of rows can be assembled (:func:`per_row_inputs`);
* :class:`WithRowInputs`: the real model, given the multimodal inputs of the rows TRL's
  text-only call is processing (a row subset of a multimodal micro-batch);
* :class:`LastHidden`: the real (DDP/FSDP-wrapped) model run with ``logits_to_keep=1`` (one
  position through the lm-head); a forward hook catches the backbone's last hidden state for
  the tiled loss, and TRL gets zero log-probs (never read) and the model's own aux loss.

Instruments that count forwards skip a stand-in marked ``runs_no_forward``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Mapping

#: Model inputs TRL builds from the text arguments (the rest are multimodal, cut per row by TRL).
TEXT_INPUTS = ("input_ids", "attention_mask", "output_router_logits")


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


class LastHidden:
    """The model run to its backbone's last hidden state (see the module docstring)."""

    def __init__(self, model: Any, backbone: Any) -> None:
        self.model, self.backbone = model, backbone
        self.hidden: list[Any] = []

    def __call__(self, *, labels: Any = None, fused_lm_head: bool = False, **inputs: Any) -> Any:
        caught: dict[str, Any] = {}

        def catch(module: Any, args: Any, output: Any) -> None:
            caught["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

        handle = self.backbone.register_forward_hook(catch)
        try:
            out = self.model(**inputs, logits_to_keep=1, use_cache=False)
        finally:
            handle.remove()
        hidden = caught["hidden"]
        self.hidden.append(hidden)
        zeros = hidden.new_zeros(hidden.shape[:2], dtype=hidden.dtype).float()
        return SimpleNamespace(log_probs=zeros, entropy=zeros, aux_loss=getattr(out, "aux_loss", None), logits=None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)
