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

#: Code markers, newest first: (the version such a source is at least, file under the package, text in it or
#: ``None``: the file exists).
MARKERS: tuple[tuple[str, str, str | None], ...] = (
    ("0.3.1.dev0", "olmo_core_hybrid.py", None),  # main after v0.3.0 (2026-08)
    ("0.3.0", "grpo_utils.py", "def resolve_old_logprob("),
)
#: What a source without any marker is reported as (below the supported range: one clear error).
OLDER = "0.2.0"
#: setuptools_scm's line: ``__version__ = version = '0.3.1.dev12+g1234'``.
_SCM = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?["']([^"']+)["']""", re.MULTILINE)


def package_dir(package: str) -> Path | None:
    """The directory ``import <package>`` would use (not imported)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


@functools.lru_cache(maxsize=8)
def _detect(package: Path, distribution: str) -> tuple[str, str]:
    written = package / "_version.py"
    try:
        found = _SCM.search(written.read_text())
    except OSError:
        found = None
    if found:
        return found.group(1), f"{written} says {found.group(1)} (setuptools_scm)"
    try:
        installed = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        installed = None
    if installed is not None:
        return installed, f"the {distribution} distribution's metadata says {installed}"
    for version, path, text in MARKERS:
        try:
            found = (package / path).exists() if text is None else text in (package / path).read_text()
        except OSError:
            found = False
        if found:
            what = f"has {text!r}" if text else "exists"
            return version, f"{package} is a checkout without version metadata; {path} {what}: {version} or later"
    return OLDER, f"{package} is a checkout without version metadata and without v0.3.0's code: older than 0.3.0"


def read_version(package: str, distribution: str) -> str | None:
    """The version of the importable ``package`` (``None``: not importable); ``distribution`` is its
    name on an install (``__init__.py`` binds both)."""
    found = package_dir(package)
    return None if found is None else _detect(found, distribution)[0]


def origin(package: str, distribution: str) -> str | None:
    """How :func:`read_version` found the number (for ``status()``)."""
    found = package_dir(package)
    return None if found is None else _detect(found, distribution)[1]
