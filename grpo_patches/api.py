"""Public API: enable / disable / status, each patch record applied when its own module loads.

Records are triggered per module (ddtrace-style post-import hooks): a Ray worker that imports
only worker modules gets exactly their records, and a driver never imports a module for the
sake of patching it. Every record of one module is resolved before any is applied.

Lock order: the API lock is never held while anything is imported. Applying a module's
records reads ``sys.modules`` only, so the post-import hook (which runs inside the import
machinery, holding that module's import lock) may take the API lock safely.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import wrapt
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from grpo_patches import instance_state, registry, savings, verify_log
from grpo_patches.errors import UnsupportedFrameworkError
from grpo_patches.options import OPTIMIZATIONS, Options
from grpo_patches.patching import AppliedPatch, PatchTarget, apply_targets, restore_all
from grpo_patches.registry import Adapter


@dataclass
class _Record:
    target: PatchTarget
    applied: AppliedPatch | None = None


@dataclass
class _Enabled:
    adapter: Adapter
    version: Version
    options: Options
    via_all: bool
    records: list[_Record]
    notes: dict[str, str] = field(default_factory=dict)
    by_class: dict[str, dict[str, str]] = field(default_factory=dict)  # trainer class -> its notes
    order: list[AppliedPatch] = field(default_factory=list)  # application order, for exact undo
    switched_off: dict[str, str] = field(default_factory=dict)  # option -> why verification turned it off

    def pending(self, module: str | None = None) -> list[_Record]:
        return [r for r in self.records if r.applied is None and module in (None, r.target.module)]


_lock = threading.RLock()
_enabled: dict[str, _Enabled] = {}
_errors: dict[str, str] = {}  # framework -> why its last deferred application failed
_hooked: set[str] = set()  # modules with a post-import hook registered and not fired yet
_registering = threading.local()


def _support(adapter: Adapter) -> tuple[Version | None, str | None]:
    """The installed version and why it cannot be patched: ``None`` (it can), ``"missing"``,
    ``"range"`` (outside ``adapter.supported``) or ``"targets"`` (no patch records for it)."""
    version = adapter.installed_version()
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
            f"install a supported version ({adapter.shown_range}): {adapter.how_to_install}"
        )
    if problem == "range":
        names = ", ".join(dict.fromkeys(t.name for t in adapter.patches)) or "none"
        raise UnsupportedFrameworkError(
            f"{adapter.name} {version} is outside the supported range {adapter.shown_range} ({adapter.supported}; "
            f"targets: {names}); install a supported version ({adapter.how_to_install}) or call "
            f"grpo_patches.disable({adapter.name!r})"
        )
    if problem == "targets":
        raise UnsupportedFrameworkError(
            f"{adapter.name} {version}: {adapter.description or 'no patch targets for this version'}"
        )
    return version  # type: ignore[return-value]


def enable(framework: str, **options: Any) -> None:
    """Patch ``framework`` ("trl", "verl", "nemo_rl", or "all" installed supported ones).

    Idempotent: enabling again with the same options does nothing; with other options the
    patches are re-applied with the new ones. Each record is applied when its module is
    imported (at once for modules already imported). Options: :class:`~grpo_patches.options.Options`.

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
    targets, notes = adapter.select(version, opts, strict=not via_all)
    with _lock:
        current = _enabled.get(adapter.name)
        if current is not None:
            if current.options == opts and current.via_all == via_all:
                return
            _disable_one(adapter.name)
        state = _Enabled(adapter, version, opts, via_all, [_Record(t) for t in targets], dict(notes))
        _enabled[adapter.name] = state
        _errors.pop(adapter.name, None)
    _trigger(state)  # outside the lock: it may wait for another thread's import


def _loaded(module: str) -> bool:
    """Imported and fully initialised (not half-way through another thread's import)."""
    mod = sys.modules.get(module)
    return mod is not None and not getattr(getattr(mod, "__spec__", None), "_initializing", False)


def _trigger(state: _Enabled) -> None:
    modules = list(dict.fromkeys(r.target.module for r in state.records))
    ready = [m for m in modules if _loaded(m)]
    _apply_modules(state, ready)  # every record of every imported module resolved before any is applied
    for module in modules:
        if module in ready:
            continue
        if module in sys.modules:  # being imported right now
            with _lock:
                hooked = module in _hooked
            if hooked:
                continue  # the pending post-import hook applies it when that import finishes
            importlib.import_module(module)  # another thread's import: wait for it (no lock held)
            if not _loaded(module):
                raise UnsupportedFrameworkError(
                    f"grpo_patches.enable({state.adapter.name!r}) was called while {module} is being imported "
                    "by this thread; call it before importing the framework or after"
                )
            _apply_modules(state, [module])
            continue
        _hook(module)


def _hook(module: str) -> None:
    with _lock:
        if module in _hooked:
            return
        _hooked.add(module)
    _registering.active = True
    try:
        wrapt.register_post_import_hook(_on_import, module)  # fires at once if imported meanwhile
    finally:
        _registering.active = False


def _on_import(module: Any) -> None:
    """Apply every enabled record of this module (errors surface at its import)."""
    name = module.__name__
    with _lock:
        _hooked.discard(name)  # wrapt fires a hook once, then forgets it
    if getattr(_registering, "active", False) and not _loaded(name):
        importlib.import_module(name)  # registered during another thread's import: wait for it
    with _lock:
        states = [s for s in _enabled.values() if s.pending(name)]
    for state in states:
        _apply_modules(state, [name])


def _apply_modules(state: _Enabled, modules: list[str]) -> None:
    """Apply the pending records of ``modules`` (imported); on failure undo the framework."""
    if not modules:
        return
    with _lock:
        if _enabled.get(state.adapter.name) is not state:
            return  # disabled or re-enabled meanwhile
        records = [r for r in state.records if r.applied is None and r.target.module in modules]
        if not records:
            return
        adapter = state.adapter
        try:
            applied = apply_targets(adapter.name, state.version, adapter.supported, [r.target for r in records])
        except Exception as exc:
            _errors[adapter.name] = str(exc)
            _disable_one(adapter.name)  # not patched: status must say so, not "pending"
            raise
        for record, patch in zip(records, applied):
            record.applied = patch
        state.order.extend(applied)


def disable(framework: str | None = None) -> None:
    """Undo the patches of ``framework`` (all when ``None``), restoring the originals exactly,
    and forget every per-instance state the adapter kept."""
    with _lock:
        if framework in (None, "all"):
            names = list(dict.fromkeys([*_enabled, *instance_state.frameworks()]))
        else:
            registry.get(framework)  # unknown names are an error, not a silent no-op
            names = [framework]
        for name in names:
            _disable_one(name)


def _disable_one(name: str) -> None:
    state = _enabled.pop(name, None)
    if state is not None:
        restore_all(state.order)
    instance_state.clear(name)


def active_options(framework: str) -> Options | None:
    """Options in force for ``framework`` (``None`` when it is not enabled). Wrappers read this.

    An optimization that verification switched off (:func:`switch_off`) reads ``False`` here
    for the rest of the run, whatever was enabled."""
    state = _enabled.get(framework)
    if state is None:
        return None
    if not state.switched_off:
        return state.options
    return dataclasses.replace(state.options, **{option: False for option in state.switched_off})


def switch_off(framework: str, option: str, reason: str) -> None:
    """Switch ``option`` off for the rest of the run (verify mode's ``verify_action="disable"``);
    ``status()`` says so in the option's note. A later :func:`enable` or :func:`disable` forgets it."""
    if option not in OPTIMIZATIONS:
        raise ValueError(f"switch_off: {option!r} is not one of {', '.join(OPTIMIZATIONS)}")
    with _lock:
        state = _enabled.get(framework)
        if state is not None:
            state.switched_off.setdefault(option, reason)
            state.notes[option] = f"off: {state.switched_off[option]}"


def enabled_via_all(framework: str) -> bool:
    state = _enabled.get(framework)
    return bool(state and state.via_all)


def strict(framework: str, option: str) -> bool:
    """Whether ``option`` was asked for explicitly (``True``; ``verify_every``: any step count;
    not via ``"all"``): an optimization that cannot run exactly must then raise instead of
    switching itself off, and verify mode must never go unchecked silently."""
    state = _enabled.get(framework)
    if not state or state.via_all:
        return False
    value = getattr(state.options, option)
    return value is True or (option == "verify_every" and value is not None)


def note(framework: str, key: str, text: str | None, owner: Any = None) -> None:
    """Attach (or clear, with ``None``) a status note, e.g. why an optimization is off.

    :param owner: the framework object (or class) the note is about: what ran can differ per
        trainer class (a subclass that overrides a wrapped method), so such notes are kept per
        class, under ``status()[framework]["by_class"][<class name>]``.
    """
    with _lock:
        state = _enabled.get(framework)
        if state is None:
            return
        if owner is not None:
            klass = owner if isinstance(owner, type) else type(owner)
            notes = state.by_class.setdefault(f"{klass.__module__}.{klass.__qualname__}", {})
        else:
            notes = state.notes
        if text is None:
            notes.pop(key, None)
        else:
            notes[key] = text


def _record_states(state: _Enabled) -> list[dict[str, Any]]:
    chosen = {id(r.target): r for r in state.records}
    rows = []
    for target in state.adapter.targets(state.version):
        record = chosen.get(id(target))
        if record is not None:
            where = "applied" if record.applied else "pending import"
        else:
            where = f"off ({target.option}={getattr(state.options, target.option)!r})"
        rows.append({"target": target.name, "option": target.option, "state": where})
    return rows


def _stacks(state: _Enabled) -> dict[str, list[str]]:
    """Each patched attribute's wrappers as they run, outermost first (a later record wraps an
    earlier one): ``{"module:Class.method": ["package.module:wrapper (option)", ...]}``."""
    stacks: dict[str, list[str]] = {}
    for patch in reversed(state.order):
        target = patch.target
        stacks.setdefault(target.name, []).append(
            target.wrapper_name + (f" ({target.option})" if target.option else ""))
    return dict(sorted(stacks.items()))


def _summary(framework: str, applied: list[str], waiting: list[str]) -> str:
    """``status()``'s state of an enabled framework in words: a record waiting for its module
    to be imported is not a failure (``import trl`` alone imports no trainer module)."""
    def listed(modules: list[str]) -> str:
        return " and ".join(", ".join(modules).rsplit(", ", 1))

    if not waiting:
        return f"patched ({listed(applied)})" if applied else "enabled; no patch record applies with these options"
    one = len(waiting) == 1
    if applied:
        return (f"patched in {listed(applied)}; the patches of {listed(waiting)} apply when "
                f"{'it is' if one else 'they are'} imported")
    return f"enabled, not patched yet: the {framework} patches apply when {listed(waiting)} {'is' if one else 'are'} imported"


def status() -> dict[str, dict[str, Any]]:
    """Per framework: installed version, supported or why not, what is patched (per record),
    options, notes and savings, and which process this is (workers report their own).

    An enabled framework also has ``summary`` (its state in words), ``waiting_for``: the
    modules whose records apply when they are imported (``pending_import`` is then true), and
    ``stacks``: each patched attribute's wrappers in the order they run, outermost first.
    """
    report: dict[str, dict[str, Any]] = {}
    process = f"pid {os.getpid()} ({sys.executable})"
    for name in registry.names():
        adapter = registry.get(name)
        try:
            version, problem = _support(adapter)
        except UnsupportedFrameworkError as exc:
            version, problem = None, str(exc)
        reasons = {
            "missing": "not installed",
            "range": f"{version} outside {adapter.shown_range}",
            "targets": adapter.description or "no adapter yet",
        }
        entry: dict[str, Any] = {
            "installed": str(version) if version else None,
            "supported_range": adapter.supported,
            "supported_versions": adapter.shown_range,
            "supported": problem is None,
            "reason": reasons.get(problem, problem or ""),
            "patched": False,
            "pending_import": False,
            "options": None,
            "notes": {},
            "savings": savings.totals(name),
            "process": process,
        }
        if adapter.version_origin is not None and version is not None:
            entry["version_origin"] = adapter.version_origin()
        if name in _errors:
            entry["error"] = _errors[name]
        state = _enabled.get(name)
        if state is not None:
            waiting = list(dict.fromkeys(r.target.module for r in state.pending()))
            applied = list(dict.fromkeys(r.target.module for r in state.records if r.applied))
            entry.update(
                patched=bool(state.order),
                pending_import=bool(waiting),
                waiting_for=waiting,
                summary=_summary(name, applied, waiting),
                options=state.options.as_dict(),
                notes=dict(state.notes),
                by_class={name: dict(notes) for name, notes in state.by_class.items()},
                targets=[p.target.name for p in state.order],
                patches=_record_states(state),
                stacks=_stacks(state),
                not_applicable=[o for o in OPTIMIZATIONS if o in adapter.inapplicable(state.version)],
                switched_off=dict(state.switched_off),
            )
        verified = verify_log.report(name)
        if verified is not None:
            entry["verify"] = verified
        report[name] = entry
    return report
