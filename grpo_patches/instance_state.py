"""One state object per patched instance (a trainer, an actor), cleared by ``disable()``.

Like ddtrace's ``Pin``: an adapter keeps everything it remembers about one framework object
in a single object stored on it, instead of loose attributes. ``disable(framework)`` drops
the states of that framework from every instance, so a later ``enable`` starts fresh.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, TypeVar

T = TypeVar("T")

#: The one attribute grpo_patches sets on framework objects: ``{framework: state}``.
ATTR = "_grpo_patches"

_lock = threading.Lock()
_owners: dict[str, weakref.WeakSet] = {}
_strong: dict[str, dict[int, Any]] = {}  # objects without weakref support (rare: test stand-ins)


def state_of(instance: Any, framework: str, factory: Callable[[], T]) -> T:
    """The ``framework`` adapter's state for ``instance``, created with ``factory()`` on first use."""
    states = instance.__dict__.get(ATTR)
    if states is None:
        states = instance.__dict__.setdefault(ATTR, {})
    state = states.get(framework)
    if state is None:
        state = states.setdefault(framework, factory())
        with _lock:
            try:
                _owners.setdefault(framework, weakref.WeakSet()).add(instance)
            except TypeError:
                _strong.setdefault(framework, {})[id(instance)] = instance
    return state


def peek(instance: Any, framework: str) -> Any | None:
    """The state if one exists (never creates it)."""
    return instance.__dict__.get(ATTR, {}).get(framework)


def frameworks() -> list[str]:
    """Frameworks that hold state on some live instance."""
    with _lock:
        return [name for name in {**_owners, **_strong} if len(_owners.get(name, ())) or _strong.get(name)]


def clear(framework: str) -> int:
    """Drop ``framework``'s state from every instance; returns how many were cleared."""
    with _lock:
        owners = [*_owners.pop(framework, ()), *_strong.pop(framework, {}).values()]
    for instance in owners:
        states = instance.__dict__.get(ATTR)
        if states is not None:
            states.pop(framework, None)
            if not states:
                instance.__dict__.pop(ATTR, None)
    return len(owners)
