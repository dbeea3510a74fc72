"""Call a patched method so that its warnings name the frame they name without the patch.

``warnings.warn(..., stacklevel=2)`` inside a framework method names the method's caller: its
file and line, its module (which ``warnings.filterwarnings(module=...)`` matches) and its
once-registry. A wrapper that calls the original puts its own frame there, so the framework's
warnings would name the adapter's file (seen: TRL's ``use_liger_kernel`` FutureWarning
reported from the adapter's file) and escape the user's filters.

The patching layer therefore gives the wrapper of a record that asks for it
(``PatchTarget(caller_frame=True)``: a method that warns with ``stacklevel=2``, e.g. TRL's
``GRPOTrainer.__init__``, NeMo-RL's ``grpo_train``) an :class:`OriginalCall`: calling it runs
the original through a one-line trampoline whose code carries the caller's file and line and
whose globals are the caller's. Seen from the original, its caller is where the patched
method was called. Exact for ``stacklevel=2``; a deeper level lands on the wrapper's frames.
Other records' wrappers get the original itself (no trampoline on every call). Stacked patches compose (each trampoline copies the location
it was called from). A traceback shows the trampoline as one more line of the caller.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Callable

_TEMPLATE = compile("def patched_call(__original, /, *args, **kwargs): return __original(*args, **kwargs)",
                    "<grpo_patches>", "exec")
_CODE = next(c for c in _TEMPLATE.co_consts if isinstance(c, types.CodeType))


@functools.lru_cache(maxsize=1024)
def _code_at(filename: str, lineno: int) -> types.CodeType:
    """The trampoline's code, placed at ``filename:lineno`` (cached: one per call site)."""
    return _CODE.replace(co_filename=filename, co_firstlineno=max(lineno, 1))


def caller_location(depth: int = 1) -> tuple[str, int, dict[str, Any]]:
    """``(filename, lineno, globals)`` of the frame ``depth`` levels above the caller of this
    function, skipping pure-Python wrapt frames (wrapt without its C extension)."""
    frame = sys._getframe(depth + 1)
    while frame.f_back is not None and str(frame.f_globals.get("__name__", "")).startswith("wrapt"):
        frame = frame.f_back
    return frame.f_code.co_filename, frame.f_lineno, frame.f_globals


class OriginalCall:
    """The original callable, called as if from ``location`` (see the module docstring).

    ``__wrapped__`` is the original, so ``inspect.signature`` sees the original's signature.
    """

    __slots__ = ("__wrapped__", "_location")

    def __init__(self, original: Callable[..., Any], location: tuple[str, int, dict[str, Any]]) -> None:
        self.__wrapped__ = original
        self._location = location

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        filename, lineno, module_globals = self._location
        trampoline = types.FunctionType(_code_at(filename, lineno), module_globals)
        return trampoline(self.__wrapped__, *args, **kwargs)

    def __repr__(self) -> str:
        return f"<original {self.__wrapped__!r}>"


def unwrap(wrapped: Any) -> Any:
    """The original behind an :class:`OriginalCall` (anything else as is): for wrappers that
    inspect the original itself (``inspect.ismethod``, ``__self__``, ``__module__``)."""
    return wrapped.__wrapped__ if isinstance(wrapped, OriginalCall) else wrapped


def transparent(wrapper: Callable[[Callable[..., Any], Any, tuple, dict], Any]) -> Callable[..., Any]:
    """A wrapt wrapper that calls ``wrapper`` with the original as an :class:`OriginalCall`."""

    @functools.wraps(wrapper)
    def call(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        return wrapper(OriginalCall(wrapped, caller_location(1)), instance, args, kwargs)

    return call
