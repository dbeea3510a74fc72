"""Known adapters, looked up by framework name without importing any framework."""

from __future__ import annotations

import importlib
from importlib import metadata

from grpo_patches.adapter import Adapter
from grpo_patches.errors import UnknownFrameworkError

#: Built-in adapters: framework name -> module exposing ``ADAPTER``.
BUILTIN: dict[str, str] = {
    "trl": "grpo_patches.adapters.trl",
    "verl": "grpo_patches.adapters.verl",
    "nemo_rl": "grpo_patches.adapters.nemo_rl",
}

#: Entry-point group through which other distributions declare adapters (``name = module:ADAPTER``).
ADAPTER_GROUP = "grpo_patches.adapters"

_extra: dict[str, Adapter] = {}


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ADAPTER_GROUP)}


def register_adapter(adapter: Adapter) -> None:
    """Make a third-party (or test) adapter available to ``enable(adapter.name)``."""
    _extra[adapter.name] = adapter


def unregister_adapter(name: str) -> None:
    _extra.pop(name, None)


def names() -> list[str]:
    """Every framework name ``enable`` accepts (besides ``"all"``)."""
    found = [*BUILTIN, *_extra, *_entry_points()]
    return list(dict.fromkeys(found))


def get(name: str) -> Adapter:
    if name in _extra:
        return _extra[name]
    if name not in BUILTIN:
        eps = _entry_points()
        if name in eps:
            return eps[name].load()
        valid = ", ".join([*names(), "all"])
        raise UnknownFrameworkError(f"unknown framework {name!r}; valid names are: {valid}")
    return importlib.import_module(BUILTIN[name]).ADAPTER
