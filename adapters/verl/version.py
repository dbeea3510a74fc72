"""The verl version (and code line) this process runs, read at call time.

The patch table narrows each record to the versions whose internals it wraps; a wrapper that
behaves differently per line asks here.
"""

from __future__ import annotations

from typing import Any


def installed() -> Any:
    """The installed verl's :class:`packaging.version.Version`."""
    from importlib import metadata

    from packaging.version import Version

    from . import ADAPTER

    return Version(metadata.version(ADAPTER.distribution))


def engine_skip_available() -> bool:
    """Whether this verl's engine worker has the old-logprob skip's worker-side records (the loss's substitute)."""
    from packaging.specifiers import SpecifierSet

    from . import ENGINE_OLD_SKIP

    return installed() in SpecifierSet(ENGINE_OLD_SKIP)
