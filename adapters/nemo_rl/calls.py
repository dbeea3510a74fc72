"""Small helpers shared by the wrappers: call arguments by name, tensors without importing torch early."""

from __future__ import annotations

import inspect
import types
from types import FrameType
from typing import Any, Callable

from grpo_patches.caller_frame import unwrap

_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def _undecorated(function: Callable[..., Any]) -> Callable[..., Any]:
    """The function a ``(*args, **kwargs)`` decorator wraps: NeMo-RL's ``@wrap_with_nvtx_name``
    keeps it in its closure without ``functools.wraps`` (Ray's tracing then adds a
    ``_ray_trace_ctx`` keyword to the wrapper's signature of an actor class's methods)."""
    for _ in range(4):
        parameters = inspect.signature(function).parameters.values()
        if any(p.kind not in _VARIADIC and not p.name.startswith("_ray_") for p in parameters):
            return function
        inner = getattr(function, "__wrapped__", None)
        if inner is None:
            cells = getattr(function, "__closure__", None) or ()
            inner = next((c.cell_contents for c in cells if isinstance(c.cell_contents, types.FunctionType)), None)
        if inner is None:
            return function
        function = inner
    return function


def arguments(wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by parameter name, defaults included (``self`` excluded for methods)."""
    wrapped = unwrap(wrapped)  # the patching layer hands wrappers a call-site-preserving proxy
    if inspect.ismethod(wrapped):
        function = _undecorated(wrapped.__func__)
        bound = inspect.signature(function).bind(wrapped.__self__, *args, **kwargs)
        bound.apply_defaults()
        return dict(list(bound.arguments.items())[1:])
    bound = inspect.signature(_undecorated(wrapped)).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def zero_logprobs(data: Any) -> Any:
    """``{"...": zeros}``-style placeholder values: fp32 zeros shaped like ``data["input_ids"]``."""
    import torch

    return torch.zeros(tuple(data["input_ids"].shape), dtype=torch.float32)


#: The DTensor policy worker v2's source file (every tag): its ``train`` frame is found by it.
WORKER_FILE = "dtensor_policy_worker_v2.py"
#: The Megatron policy worker's source file (:mod:`.filter_megatron_worker`).
MEGATRON_WORKER_FILE = "megatron_policy_worker.py"


def worker_train_frame(frame: FrameType | None, worker_file: str = WORKER_FILE) -> FrameType | None:
    """The worker's ``train`` frame (``worker_file``: the DTensor worker's by default) when it is
    ``frame`` (a wrapper's caller) or just above."""
    for _ in range(4):  # the patching layer's call-site trampoline and wrapt's pure-Python fallback add frames
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == "train" and code.co_filename.endswith(worker_file):
            return frame
        frame = frame.f_back
    return None
