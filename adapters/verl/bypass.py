"""Every verl record's wrapper passes straight through while verify mode runs verl's unpatched
computation (:mod:`.verify`).

A verify step runs verl's own update a second time, as the unpatched framework would: the
filter, the skips, the tiled loss and the guards must all stand aside for it, including the
wrappers that fire deep inside verl's call (``forward_step``, ``FusedLinearForPPO.forward``,
``get_policy_loss_fn``). :class:`Bypassable` wraps each record's wrapper (named by string, as
the patch table declares it, so importing the table still imports neither torch nor verl) and
calls the original instead while :func:`unpatched` is active.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import sys
from typing import Any, Callable, Iterator

_UNPATCHED: contextvars.ContextVar = contextvars.ContextVar("grpo_patches_verl_unpatched", default=False)


def active() -> bool:
    """Whether verl's unpatched computation is running (every record passes through)."""
    return _UNPATCHED.get()


@contextlib.contextmanager
def unpatched() -> Iterator[None]:
    """Run the block as verl without grpo_patches."""
    token = _UNPATCHED.set(True)
    try:
        yield
    finally:
        _UNPATCHED.reset(token)


class Bypassable:
    """A record's wrapper (``"package.module:function"``) that passes through under :func:`unpatched`."""

    __slots__ = ("path", "_module", "_name")

    def __init__(self, path: str) -> None:
        self.path = path
        self._module, _, self._name = path.partition(":")

    def __call__(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        if _UNPATCHED.get():
            return wrapped(*args, **kwargs)
        # looked up on every call, never cached: the module's current function, as a record named by
        # string resolves it (a reloaded module or a test's planted fault is seen at once)
        module = sys.modules.get(self._module) or importlib.import_module(self._module)
        return getattr(module, self._name)(wrapped, instance, args, kwargs)

    def __reduce__(self) -> tuple:
        return Bypassable, (self.path,)

    def __repr__(self) -> str:
        return f"Bypassable({self.path!r})"


def bypassable(records: tuple) -> tuple:
    """``records`` with each string-named wrapper made :class:`Bypassable`, except verify mode's own
    (option ``verify_every``: they run the unpatched computation and watch it)."""
    return tuple(dataclasses.replace(r, wrapper=Bypassable(r.wrapper))
                 if isinstance(r.wrapper, str) and r.option != "verify_every" else r for r in records)
