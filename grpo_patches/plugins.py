"""The plugin manager: hookspecs, built-in defaults (``trylast``) and entry-point plugins."""

from __future__ import annotations

import os
import threading

import pluggy

from grpo_patches import hookspecs
from grpo_patches.hook_contracts import CheckedHooks

#: Set to any non-empty value other than ``0`` to skip loading ``grpo_patches`` entry points.
AUTOLOAD_ENV = "GRPO_PATCHES_DISABLE_PLUGIN_AUTOLOAD"

_lock = threading.Lock()
_pm: pluggy.PluginManager | None = None


def _autoload_disabled() -> bool:
    return os.environ.get(AUTOLOAD_ENV, "") not in ("", "0")


def plugin_manager() -> pluggy.PluginManager:
    """Return the process-wide plugin manager, creating it on first use."""
    global _pm
    if _pm is None:
        with _lock:
            if _pm is None:
                pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
                pm.add_hookspecs(hookspecs)
                from grpo_patches import defaults

                pm.register(defaults, name="grpo_patches.defaults")
                if not _autoload_disabled():
                    pm.load_setuptools_entrypoints(hookspecs.PROJECT_NAME)
                _pm = pm
    return _pm


def hook() -> CheckedHooks:
    """``plugin_manager().hook`` with every decision hook's answer checked against its contract
    (:mod:`grpo_patches.hook_contracts`): what adapters call."""
    return CheckedHooks(plugin_manager())
