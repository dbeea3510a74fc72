"""Small helpers shared by the wrappers: call arguments by name, tensors without importing torch early."""

from __future__ import annotations

import inspect
from typing import Any, Callable


def arguments(wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by parameter name, defaults included (``self`` excluded for methods)."""
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def zero_logprobs(data: Any) -> Any:
    """``{"...": zeros}``-style placeholder values: fp32 zeros shaped like ``data["input_ids"]``."""
    import torch

    return torch.zeros(tuple(data["input_ids"].shape), dtype=torch.float32)
