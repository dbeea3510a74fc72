"""Public API: enable / disable / status, with patching deferred until the framework loads."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import wrapt
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from grpo_patches import registry, savings
from grpo_patches.adapter import Adapter
from grpo_patches.errors import UnsupportedFrameworkError
from grpo_patches.options import Options
from grpo_patches.patching import AppliedPatch, apply_all, restore_all


@dataclass
class _Enabled:
    adapter: Adapter
    version: Version
    options: Options
    via_all: bool
    applied: list[AppliedPatch] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def pending(self) -> bool:
        return not self.applied


_lock = threading.RLock()
_enabled: dict[str, _Enabled] = {}
_hooked_modules: set[str] = set()


def installed_version(adapter: Adapter) -> Version | None:
    try:
        return Version(metadata.version(adapter.distribution))
    except metadata.PackageNotFoundError:
        return None


def _support(adapter: Adapter) -> tuple[Version | None, str | None]:
    """The installed version and why it cannot be patched: ``None`` (it can), ``"missing"``,
    ``"range"`` (outside ``adapter.supported``) or ``"targets"`` (no patch records for it)."""
    version = installed_version(adapter)
    if version is None:
        return None, "missing"
    if not SpecifierSet(adapter.supported).contains(version, prereleases=True):
        return version, "range"
    if not adapter.targets(version):
        return version, "targets"
    return version, None


def _check_supported(adapter: Adapter) -> Version:
    version, problem = _support(adapter)
    if problem == "missing":
        raise UnsupportedFrameworkError(
            f"{adapter.name} is not installed (distribution {adapter.distribution!r}); "
            f"install a version in {adapter.supported}, e.g. pip install 'grpo-patches[{adapter.name}]'"
        )
    if problem == "range":
        raise UnsupportedFrameworkError(
            f"{adapter.name} {version} is outside the supported range {adapter.supported} "
            f"(targets: {', '.join(t.name for t in adapter.targets(version)) or 'none'}); "
            f"install a version in {adapter.supported} or call grpo_patches.disable({adapter.name!r})"
        )
    if problem == "targets":
        raise UnsupportedFrameworkError(
            f"{adapter.name} {version}: {adapter.description or 'no patch targets for this version'}"
        )
    return version


def enable(framework: str, **options: Any) -> None:
    """Patch ``framework`` ("trl", "verl", "nemo_rl", or "all" installed supported ones).

    Idempotent: enabling again with the same options does nothing; with other options the
    patches are re-applied with the new ones. If the framework is not imported yet, the
    patches are applied when it is. Options: see :class:`grpo_patches.options.Options`.

    :raises OptionError: unknown option or value.
    :raises UnknownFrameworkError: unknown framework name.
    :raises UnsupportedFrameworkError: framework missing, out of range, or a target moved.
    """
    opts = Options.from_kwargs(options)
    if framework == "all":
        for name in registry.names():
            adapter = registry.get(name)
            if _support(adapter)[1] is None:  # a moved target still raises, from _enable_one
                _enable_one(adapter, opts, via_all=True)
        return
    _enable_one(registry.get(framework), opts, via_all=False)


def _enable_one(adapter: Adapter, opts: Options, via_all: bool) -> None:
    version = _check_supported(adapter)
    with _lock:
        current = _enabled.get(adapter.name)
        if current is not None:
            if current.options == opts and current.via_all == via_all:
                return
            _disable_one(adapter.name)
        state = _Enabled(adapter, version, opts, via_all)
        if adapter.trigger_module in sys.modules:
            state.applied = apply_all(adapter.name, version, adapter.selected_targets(version, opts))
            _enabled[adapter.name] = state
            return
        _enabled[adapter.name] = state
        if adapter.trigger_module not in _hooked_modules:
            _hooked_modules.add(adapter.trigger_module)
            wrapt.register_post_import_hook(_on_import, adapter.trigger_module)


def _on_import(module: Any) -> None:
    """Apply every enable() that was waiting for this module (errors surface at import)."""
    with _lock:
        _hooked_modules.discard(module.__name__)  # wrapt fires a hook once, then forgets it
        for state in list(_enabled.values()):
            if state.adapter.trigger_module == module.__name__ and state.pending:
                try:
                    state.applied = apply_all(
                        state.adapter.name, state.version, state.adapter.selected_targets(state.version, state.options)
                    )
                except Exception:
                    _enabled.pop(state.adapter.name, None)  # not patched: status must not say "pending"
                    raise


def disable(framework: str | None = None) -> None:
    """Undo the patches of ``framework`` (all when ``None``), restoring the originals exactly."""
    with _lock:
        for name in list(_enabled) if framework in (None, "all") else [framework]:
            if framework not in (None, "all"):
                registry.get(name)  # unknown names are an error, not a silent no-op
            _disable_one(name)


def _disable_one(name: str) -> None:
    state = _enabled.pop(name, None)
    if state is not None:
        restore_all(state.applied)


def active_options(framework: str) -> Options | None:
    """Options in force for ``framework`` (``None`` when it is not enabled). Wrappers read this."""
    state = _enabled.get(framework)
    return None if state is None else state.options


def enabled_via_all(framework: str) -> bool:
    state = _enabled.get(framework)
    return bool(state and state.via_all)


def note(framework: str, key: str, text: str | None) -> None:
    """Attach (or clear, with ``None``) a status note, e.g. why an optimization is off."""
    with _lock:
        state = _enabled.get(framework)
        if state is None:
            return
        if text is None:
            state.notes.pop(key, None)
        else:
            state.notes[key] = text


def status() -> dict[str, dict[str, Any]]:
    """Per framework: installed version, supported or why not, patched, options, savings."""
    report: dict[str, dict[str, Any]] = {}
    for name in registry.names():
        adapter = registry.get(name)
        version, problem = _support(adapter)
        reasons = {
            "missing": "not installed",
            "range": f"{version} outside {adapter.supported}",
            "targets": adapter.description or "no adapter yet",
        }
        entry: dict[str, Any] = {
            "installed": str(version) if version else None,
            "supported_range": adapter.supported,
            "supported": problem is None,
            "reason": reasons.get(problem, ""),
            "patched": False,
            "pending_import": False,
            "options": None,
            "notes": {},
            "savings": savings.totals(name),
        }
        state = _enabled.get(name)
        if state is not None:
            entry.update(
                patched=not state.pending,
                pending_import=state.pending,
                options=state.options.as_dict(),
                notes=dict(state.notes),
                targets=[p.target.name for p in state.applied],
            )
        report[name] = entry
    return report
