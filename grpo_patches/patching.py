"""Patch records and how they are resolved, applied (with wrapt) and undone exactly."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import wrapt
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from grpo_patches.errors import UnsupportedFrameworkError

#: wrapt wrapper: ``wrapper(wrapped, instance, args, kwargs) -> result``.
Wrapper = Callable[[Callable[..., Any], Any, tuple, dict], Any]


@dataclass(frozen=True)
class PatchTarget:
    """One declared patch: ``module``'s (dotted) ``attribute`` gets wrapped by ``wrapper``.

    :ivar versions: PEP 440 range of the framework's distribution this record is valid for.
    :ivar option: the :class:`~grpo_patches.options.Options` field that switches this patch
        on (``None``: always applied while the framework is enabled).
    """

    module: str
    attribute: str
    wrapper: Wrapper
    versions: str
    option: str | None = None

    @property
    def name(self) -> str:
        return f"{self.module}:{self.attribute}"

    def supports(self, version: Version) -> bool:
        return SpecifierSet(self.versions).contains(version, prereleases=True)


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
    module = importlib.import_module(target.module)
    *path, attribute = target.attribute.split(".")
    parent: Any = module
    for part in path:
        parent = getattr(parent, part)
    if isinstance(parent, type):
        for klass in parent.__mro__:  # raw class attribute: keeps staticmethod/classmethod
            if attribute in vars(klass):
                return parent, attribute, vars(klass)[attribute], klass is parent
        raise AttributeError(attribute)
    return parent, attribute, getattr(parent, attribute), True


def apply_all(framework: str, version: Version, targets: Sequence[PatchTarget]) -> list[AppliedPatch]:
    """Resolve every target first, then apply them all; nothing is half-applied.

    :raises UnsupportedFrameworkError: naming framework, version, target and range for every
        target that is out of range or cannot be found.
    """
    problems: list[str] = []
    resolved = []
    for target in targets:
        if not target.supports(version):
            problems.append(f"{target.name} supports {framework} {target.versions}")
            continue
        try:
            resolved.append((target, *_resolve(target)))  # everything must exist first
        except (ImportError, AttributeError) as exc:
            problems.append(f"{target.name} not found ({type(exc).__name__}: {exc}); declared for {target.versions}")
    if problems:
        raise UnsupportedFrameworkError(
            f"cannot patch {framework} {version}: " + "; ".join(problems)
            + ". Install a supported version or disable the optimization that needs it."
        )
    applied = []
    for target, *_ in resolved:
        # resolve again: a later record on the same attribute wraps the earlier one
        parent, attribute, original, owned = _resolve(target)
        proxy = wrapt.FunctionWrapper(original, target.wrapper)
        setattr(parent, attribute, proxy)
        applied.append(AppliedPatch(target, parent, attribute, original, owned, proxy))
    return applied


def restore_all(applied: Sequence[AppliedPatch]) -> None:
    """Undo patches in reverse order of application."""
    for patch in reversed(applied):
        patch.restore()
