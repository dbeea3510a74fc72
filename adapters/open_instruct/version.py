"""Which open-instruct is importable, read without importing it.

open-instruct is not on PyPI. Installed (``uv sync``, ``pip install -e .``), setuptools_scm writes
its version into ``open_instruct/_version.py`` and the distribution's metadata (``0.3.0`` at the
tag, ``0.3.1.devN+g<hash>`` after it). Run from a checkout on ``PYTHONPATH`` (as its cells and many
cluster jobs do) there is neither, and ``open_instruct.__version__`` falls back to ``0.0.0``; the
version is then read from the code itself (:data:`MARKERS`, newest first): main after v0.3.0 is
reported as ``0.3.1.dev0``, v0.3.0 as ``0.3.0``, anything older (v0.2.0 has no
``resolve_old_logprob``, whose call the adapter's placeholders guard) as ``0.2.0``.
:func:`origin` says how the number was found; ``grpo_patches.status()`` shows it.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from importlib import metadata
from pathlib import Path

from . import FRAMEWORK

#: Code markers, newest first: (the version such a source is at least, file under the package, text in it or
#: ``None``: the file exists).
MARKERS: tuple[tuple[str, str, str | None], ...] = (
    ("0.3.1.dev0", "olmo_core_hybrid.py", None),  # main after v0.3.0 (2026-08)
    ("0.3.0", "grpo_utils.py", "def resolve_old_logprob("),
)
#: What a source without any marker is reported as (below the supported range: one clear error).
OLDER = "0.2.0"
_SCM = re.compile(r"""^(?:__version__|version)\s*(?::\s*str)?\s*=\s*["']([^"']+)["']""", re.MULTILINE)


def package_dir() -> Path | None:
    """The package directory ``import open_instruct`` would use (the adapter's name is the import name)."""
    spec = importlib.util.find_spec(FRAMEWORK.name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


@functools.lru_cache(maxsize=8)
def _detect(package: Path) -> tuple[str, str]:
    written = package / "_version.py"
    try:
        found = _SCM.search(written.read_text())
    except OSError:
        found = None
    if found:
        return found.group(1), f"{written} says {found.group(1)} (setuptools_scm)"
    from . import ADAPTER  # at call time: the table is built after this module is imported

    try:
        installed = metadata.version(ADAPTER.distribution)
    except metadata.PackageNotFoundError:
        installed = None
    if installed is not None:
        return installed, f"the {ADAPTER.distribution} distribution's metadata says {installed}"
    for version, path, text in MARKERS:
        try:
            found = (package / path).exists() if text is None else text in (package / path).read_text()
        except OSError:
            found = False
        if found:
            what = f"has {text!r}" if text else "exists"
            return version, f"{package} is a checkout without version metadata; {path} {what}: {version} or later"
    return OLDER, f"{package} is a checkout without version metadata and without v0.3.0's code: older than 0.3.0"


def read_version() -> str | None:
    """The importable open-instruct's version (``None``: not importable)."""
    package = package_dir()
    return None if package is None else _detect(package)[0]


def origin() -> str | None:
    """How :func:`read_version` found the number (for ``status()``)."""
    package = package_dir()
    return None if package is None else _detect(package)[1]
