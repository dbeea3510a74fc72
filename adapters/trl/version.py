"""What the TRL adapter reads from the installed TRL's version at call time.

The patch table narrows records by version itself (``PatchTarget.versions``); this module
holds the version checks a wrapper makes while it runs.
"""

from __future__ import annotations

from packaging.version import Version

#: The first TRL whose log-prob method cuts multimodal inputs per row through one model call
#: (its fused path), which a :class:`~.row_subsets.RowRecorder` can answer.
MULTIMODAL_ROWS = Version("1.15")


def installed() -> Version:
    """The installed TRL's version (as the adapter reads it for its supported range)."""
    from . import ADAPTER

    version = ADAPTER.installed_version()
    if version is None:
        raise ModuleNotFoundError("trl is not installed")
    return version


def multimodal_rows_supported() -> bool:
    """Whether row subsets of multimodal micro-batches can be built (TRL >= 1.15)."""
    return installed() >= MULTIMODAL_ROWS
