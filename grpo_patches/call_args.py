"""A wrapped call's arguments by parameter name: the one binder every adapter's wrappers use.

A wrapper receives the framework's call as ``(wrapped, instance, args, kwargs)``, however the
caller passed each argument. :func:`bind` reads them by the parameter names of the wrapped
function's own signature (never a hand-written mirror of it, which would go stale when the
framework adds a parameter), defaults included, and :meth:`CallArgs.call` calls the original
again with some of them changed.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any, Callable, Iterator, Mapping

from grpo_patches.caller_frame import unwrap

__all__ = ["CallArgs", "bind"]

_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


@functools.lru_cache(maxsize=1024)
def _signature(function: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(function)


def _undecorated(function: Callable[..., Any]) -> Callable[..., Any]:
    """The function a ``(*args, **kwargs)`` decorator wraps: a decorator without
    ``functools.wraps`` keeps it in its closure (NeMo-RL's ``@wrap_with_nvtx_name``), and Ray's
    tracing adds a ``_ray_trace_ctx`` keyword to an actor class's methods."""
    for _ in range(4):
        parameters = _signature(function).parameters.values()
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


class CallArgs(Mapping[str, Any]):
    """One call's arguments by parameter name, defaults included (a bound method's ``self``
    excluded). A ``**kwargs`` parameter reads as one dict under its name."""

    __slots__ = ("_bound", "_arguments", "_skip_self")

    def __init__(self, bound: inspect.BoundArguments, skip_self: bool) -> None:
        self._bound = bound  # as the caller passed them (defaults not applied): what call() changes
        full = inspect.BoundArguments(bound.signature, bound.arguments.copy())
        full.apply_defaults()
        items = list(full.arguments.items())
        self._arguments = dict(items[1:] if skip_self else items)
        self._skip_self = skip_self

    def __getitem__(self, name: str) -> Any:
        return self._arguments[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arguments)

    def __len__(self) -> int:
        return len(self._arguments)

    def __repr__(self) -> str:
        return f"CallArgs({', '.join(self._arguments)})"

    def changed(self, **changes: Any) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of the same call with the named parameters changed (each given as
        the caller gave it, the others untouched).

        :raises TypeError: a name that is not a parameter of the call.
        """
        unknown = sorted(set(changes) - set(self._bound.signature.parameters))
        if unknown:
            raise TypeError(f"{unknown} are not parameters of {self._bound.signature}")
        bound = inspect.BoundArguments(self._bound.signature, {**self._bound.arguments, **changes})
        args = bound.args[1:] if self._skip_self else bound.args
        return tuple(args), dict(bound.kwargs)

    def call(self, wrapped: Callable[..., Any], **changes: Any) -> Any:
        """Call ``wrapped`` (the original a wrapper received) with the named parameters changed."""
        args, kwargs = self.changed(**changes)
        return wrapped(*args, **kwargs)


def bind(wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> CallArgs:
    """The arguments of ``wrapped(*args, **kwargs)`` by parameter name (a wrapt wrapper's
    ``wrapped``: a bound method, a function, or the patching layer's call-site-preserving proxy).

    :raises TypeError: the arguments do not fit the signature (as the call itself would).
    """
    wrapped = unwrap(wrapped)
    if inspect.ismethod(wrapped):
        function = _undecorated(wrapped.__func__)
        return CallArgs(_signature(function).bind(wrapped.__self__, *args, **kwargs), skip_self=True)
    return CallArgs(_signature(_undecorated(wrapped)).bind(*args, **kwargs), skip_self=False)
