"""Per-call context: what the wrappers of one framework call hand each other, typed, in one place.

A framework call that several records act on (verl's update: the filter, the skips, the tiled
loss and verify mode; TRL's loss call; NeMo-RL's ``train`` call) runs its wrappers at different
depths: the outermost one knows what the call is, an inner one (a micro-batch's forward, the
policy loss) must find it again. Each adapter declares, in its ``state.py``, one dataclass per
such call and one :class:`CallSlot` holding the current one; the outermost wrapper enters it
and inner wrappers read it by field name. Nothing else in an adapter holds a ``ContextVar``
(``tests/test_package_structure.py``): who hands what to whom is read in ``state.py``.

A slot is a :class:`contextvars.ContextVar`: the value follows the thread (and asyncio task)
that entered it and is reset on leaving, whatever the exception.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")

__all__ = ["CallSlot"]


class CallSlot(Generic[T]):
    """The current per-call context of one kind (``None`` outside such a call).

    :param name: what the context is (``"verl.update"``), for debugging only.
    """

    __slots__ = ("_var",)

    def __init__(self, name: str) -> None:
        self._var: contextvars.ContextVar[T | None] = contextvars.ContextVar(f"grpo_patches.{name}", default=None)

    @property
    def name(self) -> str:
        return self._var.name

    def current(self) -> T | None:
        """The context entered by an enclosing wrapper, or ``None``."""
        return self._var.get()

    @contextlib.contextmanager
    def entered(self, context: T) -> Iterator[T]:
        """Make ``context`` current for the block (an enclosing one comes back after it)."""
        token = self._var.set(context)
        try:
            yield context
        finally:
            self._var.reset(token)

    @contextlib.contextmanager
    def joined(self, factory: Callable[[], T]) -> Iterator[T]:
        """The enclosing context if there is one, else ``factory()`` entered for the block: the
        outermost of several wrappers of one call creates it, the others join it."""
        current = self._var.get()
        if current is not None:
            yield current
            return
        with self.entered(factory()) as context:
            yield context

    def __repr__(self) -> str:
        return f"CallSlot({self.name!r})"
