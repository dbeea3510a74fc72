"""The adapter as an object: what one framework's wrappers ask of grpo_patches, bound to its name.

Like OpenTelemetry's instrumentor object or ddtrace's ``config.<integration>``: each adapter's
``__init__.py`` creates one :class:`AdapterHandle` (``FRAMEWORK``) and its modules ask it —
the options in force, whether an option is on, notes and refusals for ``status()``, savings,
per-instance state, verify mode's schedule and pass-through — instead of naming the framework
by a string at every call. Importing this module imports neither torch nor a framework.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence, TypeVar

from grpo_patches import api, instance_state, passthrough, savings, verify
from grpo_patches.options import Options
from grpo_patches.refuse_or_note import refuse_or_note

T = TypeVar("T")

__all__ = ["AdapterHandle"]


class AdapterHandle:
    """One framework's view of grpo_patches (the framework as :func:`grpo_patches.enable` names it)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"AdapterHandle({self.name!r})"

    # -- options -------------------------------------------------------------------------------
    @property
    def options(self) -> Options | None:
        """The options in force (``None``: the framework is not enabled); an optimization that
        verify mode switched off reads ``False``."""
        return api.active_options(self.name)

    @property
    def enabled(self) -> bool:
        return api.active_options(self.name) is not None

    def on(self, option: str) -> bool:
        """Whether ``option`` is on: enabled, and its value neither ``False`` nor ``None``
        (``"auto"`` is on; the adapter may still switch it off with :meth:`refuse_or_note`)."""
        options = api.active_options(self.name)
        return options is not None and getattr(options, option) not in (False, None)

    def setting(self, option: str, default: Any = None) -> Any:
        """An option's value (``default`` when the framework is not enabled), e.g. ``tile_size``."""
        options = api.active_options(self.name)
        return default if options is None else getattr(options, option)

    def strict(self, option: str) -> bool:
        """Whether ``option`` was asked for explicitly (:func:`grpo_patches.api.strict`)."""
        return api.strict(self.name, option)

    # -- status() --------------------------------------------------------------------------------
    def note(self, key: str, text: str | None, owner: Any = None) -> None:
        """A ``status()`` note (``None`` clears it), per ``owner``'s class when given."""
        api.note(self.name, key, text, owner=owner)

    def refuse_or_note(self, option: str, reasons: str | Sequence[str], owner: Any = None) -> bool:
        """:func:`grpo_patches.refuse_or_note.refuse_or_note` for this framework: ``False``."""
        return refuse_or_note(self.name, option, reasons, owner=owner)

    def switch_off(self, option: str, reason: str) -> None:
        """Switch ``option`` off for the rest of the run (verify mode's ``"disable"``)."""
        api.switch_off(self.name, option, reason)

    def report_savings(self, **saved: float) -> None:
        """Work saved, through the ``grpo_report_savings`` hook (``status()``'s totals)."""
        savings.report(self.name, **saved)

    # -- per-instance state ------------------------------------------------------------------------
    def state_of(self, instance: Any, factory: Callable[[], T]) -> T:
        """This adapter's state on ``instance`` (:mod:`grpo_patches.instance_state`), made on first use."""
        return instance_state.state_of(instance, self.name, factory)

    def peek(self, instance: Any) -> Any | None:
        """This adapter's state on ``instance`` if it has one (never creates it)."""
        return instance_state.peek(instance, self.name)

    # -- verify mode -------------------------------------------------------------------------------
    def verify_due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (0-based) is verified (:func:`grpo_patches.verify.due`)."""
        return verify.due(self.name, step)

    @property
    def passing_through(self) -> bool:
        """Whether verify mode runs this framework's unpatched computation right now (every record
        but verify mode's own passes through: :mod:`grpo_patches.passthrough`)."""
        return passthrough.active(self.name)

    @contextlib.contextmanager
    def unpatched(self) -> Iterator[None]:
        """Run the block as the framework without grpo_patches (verify mode's own records excepted)."""
        with passthrough.unpatched(self.name):
            yield
