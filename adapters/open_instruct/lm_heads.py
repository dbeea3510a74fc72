"""The output layer of the models open-instruct's learners run, and what the tiled forward needs of it.

* The DeepSpeed learner's models are DeepSpeed engines around a Hugging Face causal LM: the
  output layer is ``engine.module.get_output_embeddings()``, an ``nn.Linear`` whose output the
  model returns as ``logits`` unchanged for the families in :data:`HF_MODEL_TYPES` (no soft-cap,
  no logit scale after it).
* The OLMo-core learner's models are OLMo-core ``Transformer`` s: the output layer is
  ``model.lm_head.w_out`` of the default ``LMHead`` (``w_out(norm(x))`` when no labels are given).

:func:`swapped` replaces the layer's ``forward`` for one model call (an instance attribute, so
the module's hooks still run: DeepSpeed ZeRO-3 gathers the partitioned weight before it and
registers the re-gather for its backward on its output).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

#: Hugging Face model types whose causal-LM forward returns the lm-head output as the logits.
HF_MODEL_TYPES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "llama", "mistral", "olmo", "olmo2", "olmo3", "olmoe")


def inner_model(model: Any) -> Any:
    """The framework model inside a DeepSpeed engine (or the model itself)."""
    return model.module if type(model).__name__ == "DeepSpeedEngine" else model


def output_layer(model: Any) -> Any:
    """The ``nn.Linear`` (or a replacement of it) that makes ``model``'s logits."""
    inner = inner_model(model)
    if hasattr(inner, "get_output_embeddings"):
        return inner.get_output_embeddings()
    head = getattr(inner, "lm_head", None)
    return getattr(head, "w_out", head)


def problems(model: Any) -> list[str]:
    """What about ``model`` the tiled forward cannot reproduce, each with the setting to change."""
    import torch

    inner = inner_model(model)
    found = []
    layer = output_layer(model)
    if not isinstance(layer, torch.nn.Linear) or type(layer).forward is not torch.nn.Linear.forward:
        found.append(f"the output layer is a {type(layer).__module__}.{type(layer).__qualname__} (e.g. a PEFT/LoRA "
                     "lm-head), not a plain nn.Linear: its logits are not hidden @ weight.T")
    if hasattr(inner, "get_output_embeddings"):
        kind = getattr(getattr(inner, "config", None), "model_type", None)
        if kind not in HF_MODEL_TYPES:
            found.append(f"model_type={kind!r}: the tiled forward knows the families whose forward returns the "
                         f"lm-head output as logits ({', '.join(HF_MODEL_TYPES)}); others may soft-cap or scale them")
    else:
        head = getattr(inner, "lm_head", None)
        if type(head).__name__ != "LMHead":
            found.append(f"the OLMo-core lm-head is a {type(head).__qualname__}: the tiled forward reproduces the "
                         "default LMHead (w_out(norm(x)))")
        weight = getattr(layer, "weight", None)
        if weight is not None and type(weight).__name__ == "DTensor" and any(
                type(p).__name__ == "Shard" for p in getattr(weight, "placements", ())):
            found.append("the lm-head weight is tensor-parallel (sharded over the vocabulary): use no tensor parallelism")
    return found


@contextlib.contextmanager
def swapped(model: Any, forward: Callable[[Any, Any], Any]) -> Iterator[None]:
    """``model``'s output layer computes ``forward(layer, hidden)`` instead of its logits for the block."""
    layer = output_layer(model)
    had = "forward" in vars(layer)
    previous = vars(layer).get("forward")
    layer.forward = lambda hidden, *rest, **kw: forward(layer, hidden)
    try:
        yield
    finally:
        if had:
            layer.forward = previous
        else:
            del layer.forward
