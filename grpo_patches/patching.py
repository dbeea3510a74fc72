"""Patch records and how they are resolved, applied (with wrapt) and undone exactly.

A record names one attribute of one module. Records are applied per module, when that module
is imported (or at once if it already is): every record of the module is resolved before any
of them is applied, so a module is never half-patched. Resolving never imports anything: it
reads the module from ``sys.modules``.
"""

from __future__ import annotations

import importlib
import operator
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import wrapt
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from grpo_patches import passthrough
from grpo_patches.caller_frame import transparent
from grpo_patches.errors import UnsupportedFrameworkError

#: wrapt wrapper: ``wrapper(wrapped, instance, args, kwargs) -> result``.
Wrapper = Callable[[Callable[..., Any], Any, tuple, dict], Any]


@dataclass(frozen=True)
class PatchTarget:
    """One declared patch: ``module``'s (dotted) ``attribute`` gets wrapped by ``wrapper``.

    :ivar wrapper: the wrapt wrapper, or ``"package.module:function"`` naming it (loaded when
        the record is applied, so a patch table imports neither torch nor the framework).
    :ivar versions: PEP 440 range of the framework for which this record exists, narrowing
        the adapter's supported range (``None``: the whole supported range). Two records for
        one attribute with disjoint ranges express a method that changed between versions.
    :ivar option: the :class:`~grpo_patches.options.Options` field that switches this patch
        on (``None``: applied whenever the framework is enabled).
    :ivar caller_frame: the wrapper calls the original as if from the patched method's caller
        (:mod:`grpo_patches.caller_frame`), for a method that warns with ``stacklevel=2`` (its
        warnings then keep the user's file, line and module filters). It costs a trampoline
        per call, so only such records set it; every record on that attribute should.
    :ivar pickle_by_reference: the patched (module-level) attribute pickles as a reference to
        where it stands, ``module.attribute``, as Python pickles a module function
        (:class:`ReferenceProxy`): for functions that Ray ships to its workers by value.
    """

    module: str
    attribute: str
    wrapper: Wrapper | str
    versions: str | None = None
    option: str | None = None
    caller_frame: bool = False
    pickle_by_reference: bool = False

    def __post_init__(self) -> None:
        if self.pickle_by_reference and "." in self.attribute:
            raise ValueError(f"{self.name}: pickle_by_reference is for module-level attributes")

    @property
    def name(self) -> str:
        return f"{self.module}:{self.attribute}"

    @property
    def passes_through(self) -> bool:
        """Whether the record stands aside while verify mode runs the framework's unpatched
        computation (:mod:`grpo_patches.passthrough`): every record but verify mode's own."""
        return self.option != "verify_every"

    @property
    def wrapper_name(self) -> str:
        """The wrapper as ``status()`` shows it (``"package.module:function"``)."""
        if isinstance(self.wrapper, str):
            return self.wrapper
        return f"{getattr(self.wrapper, '__module__', '?')}:{getattr(self.wrapper, '__qualname__', repr(self.wrapper))}"

    def applies_to(self, version: Version) -> bool:
        return self.versions is None or SpecifierSet(self.versions).contains(version, prereleases=True)

    def load_wrapper(self) -> Wrapper:
        if callable(self.wrapper):
            return self.wrapper
        module, _, qualname = self.wrapper.partition(":")
        found: Any = sys.modules.get(module) or importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
        return found


class RecordCall:
    """A record's wrapper as applied: it passes straight through while the framework's
    unpatched computation runs (:mod:`grpo_patches.passthrough`; verify mode's own records
    excepted), and a wrapper named by string is looked up at each call, never cached (the
    module's current function, as the record names it: a test's planted fault is seen at once)."""

    __slots__ = ("framework", "target")

    def __init__(self, framework: str, target: PatchTarget) -> None:
        self.framework = framework
        self.target = target

    def __call__(self, wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        if self.target.passes_through and passthrough.active(self.framework):
            return wrapped(*args, **kwargs)
        return self.target.load_wrapper()(wrapped, instance, args, kwargs)

    def __reduce__(self) -> tuple:
        return RecordCall, (self.framework, self.target)

    def __repr__(self) -> str:
        return f"RecordCall({self.framework!r}, {self.target.wrapper_name!r})"


class _ModuleByName:
    """Pickles as ``importlib.import_module(name)``: the receiver needs nothing of grpo_patches."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return importlib.import_module, (self.name,)


class ReferenceProxy(wrapt.FunctionWrapper):
    """A patch proxy that pickles as a reference to the attribute it stands at.

    Ray ships an actor class by value when its module attribute is the actor handle
    (``@ray.remote``), and with it every function its methods call by a module name, each
    pickled by reference (module + name) and looked up again in the worker. A plain
    ``wrapt.FunctionWrapper`` there either refuses to pickle, or (standing at a name it was
    imported under, ``from a import f``) passes cloudpickle's by-reference check under the
    wrapped function's own module and gets shipped unpatched, by value. This proxy pickles as
    ``operator.attrgetter(attribute)(importlib.import_module(module))``: the receiving process
    gets its own attribute -- patched if grpo_patches is enabled there, the original if not --
    as it would for the unpatched function. ``isinstance(proxy, types.FunctionType)`` is
    ``False`` (cloudpickle would take it for a function and pickle the wrapped one by value).
    """

    def __init__(self, wrapped: Any, wrapper: Any, module: str, attribute: str) -> None:
        super().__init__(wrapped, wrapper)
        self._self_location = (module, attribute)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D105 - see the class docstring
        return type(self)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, tuple[Any]]:
        module, attribute = self._self_location
        return operator.attrgetter(attribute), (_ModuleByName(module),)


@dataclass
class AppliedPatch:
    """A patch in place: enough to put the original object back exactly."""

    target: PatchTarget
    parent: Any
    attribute: str
    original: Any
    owned: bool  # the attribute lived in parent.__dict__ (else it was inherited)
    proxy: wrapt.FunctionWrapper

    def restore(self) -> None:
        if self.owned:
            setattr(self.parent, self.attribute, self.original)
        else:
            delattr(self.parent, self.attribute)


def _resolve(target: PatchTarget) -> tuple[Any, str, Any, bool]:
    """``(parent, attribute, original, owned)`` of an imported module's attribute."""
    module = sys.modules.get(target.module)
    if module is None:
        raise ImportError(f"module {target.module!r} is not imported")
    *path, attribute = target.attribute.split(".")
    parent: Any = module
    for part in path:
        parent = getattr(parent, part)
    if isinstance(parent, type):
        for klass in parent.__mro__:  # raw class attribute: keeps staticmethod/classmethod
            if attribute in vars(klass):
                return parent, attribute, vars(klass)[attribute], klass is parent
        raise AttributeError(f"type object {parent.__name__!r} has no attribute {attribute!r}")
    return parent, attribute, getattr(parent, attribute), True


def unsupported(framework: str, version: Version, supported: str, problems: Sequence[str]) -> UnsupportedFrameworkError:
    """The one error for records that cannot be applied: framework, version, targets, range."""
    return UnsupportedFrameworkError(
        f"cannot patch {framework} {version} (supported: {supported}): " + "; ".join(problems)
        + ". Install a supported version or disable the optimization that needs it."
    )


def apply_targets(framework: str, version: Version, supported: str, targets: Sequence[PatchTarget]) -> list[AppliedPatch]:
    """Resolve every target (and its wrapper) first, then apply them all in order.

    The targets' modules must be imported. Two records on one attribute stack: the later
    wraps the earlier. Every wrapper is applied as a :class:`RecordCall` (verify mode's
    pass-through, the wrapper looked up by name at each call). A record with ``caller_frame`` hands its wrapper the original as an
    :class:`~grpo_patches.caller_frame.OriginalCall` (the framework's warnings keep the user's
    frame); every other wrapper gets the original itself.

    :raises UnsupportedFrameworkError: naming framework, version, target and range for every
        target that cannot be found; nothing is applied then.
    """
    problems: list[str] = []
    for target in targets:
        try:
            _resolve(target)
            target.load_wrapper()  # a wrapper that cannot be found is an error now, not at its first call
        except (ImportError, AttributeError) as exc:
            declared = target.versions or supported
            problems.append(f"{target.name} not found ({type(exc).__name__}: {exc}); declared for {declared}")
    if problems:
        raise unsupported(framework, version, supported, problems)
    applied = []
    for target in targets:
        parent, attribute, original, owned = _resolve(target)  # again: stacked records see the earlier proxy
        call = RecordCall(framework, target)
        fn = transparent(call) if target.caller_frame else call
        if target.pickle_by_reference:
            proxy = ReferenceProxy(original, fn, target.module, target.attribute)
        else:
            proxy = wrapt.FunctionWrapper(original, fn)
        setattr(parent, attribute, proxy)
        applied.append(AppliedPatch(target, parent, attribute, original, owned, proxy))
    return applied


def overriding_class(klass: type, patched: type, attribute: str) -> type | None:
    """The first class between ``klass`` and ``patched`` (in the MRO) that defines
    ``attribute`` itself, or ``None``: then a wrapper on ``patched.<attribute>`` is what runs
    for instances of ``klass``. A subclass that overrides a wrapped method bypasses the
    wrapper unless it calls ``super()`` — adapters must not report such a patch as on."""
    for base in klass.__mro__:
        if base is patched:
            return None
        if attribute in vars(base):
            return base
    return None


def restore_all(applied: Sequence[AppliedPatch]) -> None:
    """Undo patches in reverse order of application."""
    for patch in reversed(applied):
        patch.restore()
