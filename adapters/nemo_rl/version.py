"""Which NeMo-RL is importable, read from its source files without importing it.

NeMo-RL is run from a checkout (the ``nemo-rl`` on PyPI is an empty placeholder), and its own
number lags behind its code on ``main``: ``nemo_rl/package_info.py`` there still says 0.6.0
(it was last bumped on the r0.6.0 branch; v0.7.0 is a release branch that main never merged),
although main has every v0.7.0 feature and more. The version is therefore the number in
``package_info.py``, raised to the first version that has the newest code marker present
(:data:`MARKERS`): main is reported as ``0.8.0.dev0`` (a development version after 0.7).
Tag v0.5.0 says ``0.5.0rc0`` and is reported as such. :func:`origin` says how the number was
found; ``grpo_patches.status()`` shows it. Each function takes the framework's import package
(``PACKAGE`` in the adapter's ``__init__``, which binds it for ``ADAPTER``).
"""

from __future__ import annotations

import functools
import importlib.util
import re
from pathlib import Path

from packaging.version import Version

#: Code markers of lines newer than their ``package_info.py`` says, newest first:
#: (the version such a source is at least, file under ``nemo_rl/``, text in that file).
MARKERS: tuple[tuple[str, str, str], ...] = (
    # main after v0.7.0: ClippedPGLossFn(cfg, use_fused_linear_logprobs=...) (v0.7.0 names it use_linear_ce_fusion)
    ("0.8.0.dev0", "algorithms/loss/loss_functions.py", "use_fused_linear_logprobs"),
)

_FIELD = re.compile(r'^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*["\']?([^"\'\s#]*)["\']?', re.MULTILINE)


def package_dir(package: str) -> Path | None:
    """The directory that ``import <package>`` would use (not imported)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _declared(package: Path) -> str | None:
    """The version ``package_info.py`` declares (``MAJOR.MINOR.PATCH`` + ``PRE_RELEASE``)."""
    try:
        text = (package / "package_info.py").read_text()
    except OSError:
        return None
    fields = dict(_FIELD.findall(text))
    if not {"MAJOR", "MINOR", "PATCH"} <= set(fields):
        return None
    return f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}{fields.get('PRE_RELEASE', '')}"


@functools.lru_cache(maxsize=8)
def _detect(package: Path) -> tuple[str | None, str]:
    declared = _declared(package)
    if declared is None:
        return None, f"{package}: no readable package_info.py"
    origin = f"{package}/package_info.py says {declared}"
    for floor, path, text in MARKERS:
        try:
            found = text in (package / path).read_text()
        except OSError:
            found = False
        if found and Version(floor) > Version(declared):
            return floor, f"{origin}; raised to {floor}: {package.name}/{path} has {text!r} (main after v0.7.0)"
    return declared, origin


def read_version(package: str) -> str | None:
    """The importable framework's version (``None`` when it is not importable)."""
    found = package_dir(package)
    return None if found is None else _detect(found)[0]


def origin(package: str) -> str | None:
    """How :func:`read_version` found the number (for ``status()``)."""
    found = package_dir(package)
    return None if found is None else _detect(found)[1]


def at_least(package: str, version: str) -> bool:
    """Whether the importable framework is ``version`` or newer (pre-releases of it count)."""
    found = read_version(package)
    return found is not None and Version(found) >= Version(version)
