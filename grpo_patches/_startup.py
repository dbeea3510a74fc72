"""Start-up patching, run by ``grpo_patches_startup.pth`` when ``GRPO_PATCHES`` is set.

``GRPO_PATCHES=trl`` (a comma list, or ``all``) enables those frameworks in every Python
process of the environment, deferred until the framework is imported, so Ray workers are
patched without code changes. ``GRPO_PATCHES_OPTIONS="recompute=0,tile_size=512"`` passes
options. A malformed value is reported as one warning, located at ``<start-up: GRPO_PATCHES=...>``
(there is no user frame yet); this module never raises.
"""

from __future__ import annotations

import os
import warnings

from grpo_patches.startup_path import FRAMEWORKS_ENV, OPTIONS_ENV


def run(environ: os._Environ | dict = os.environ) -> list[str]:
    """Enable what the environment asks for; return the frameworks enabled."""
    from grpo_patches import api, registry
    from grpo_patches.errors import GrpoPatchesError, GrpoPatchesWarning
    from grpo_patches.options import parse_env_options

    raw = environ.get(FRAMEWORKS_ENV, "").strip()
    if not raw or raw.lower() in ("0", "off", "none", "false"):
        return []
    names = [n.strip() for n in raw.split(",") if n.strip()]
    problems: list[str] = []
    valid = [*registry.names(), "all"]
    unknown = [n for n in names if n not in valid]
    if unknown:
        problems.append(f"unknown framework(s) {', '.join(map(repr, unknown))} (valid: {', '.join(valid)})")
    try:
        options = parse_env_options(environ.get(OPTIONS_ENV, ""))
    except GrpoPatchesError as exc:
        problems.append(f"{OPTIONS_ENV}: {exc}")
        options = None
    enabled: list[str] = []
    if options is not None:
        for name in names:
            if name in unknown:
                continue
            try:
                api.enable(name, **options)
                enabled.append(name)
            except GrpoPatchesError as exc:
                problems.append(str(exc))
    if problems:
        # at interpreter start-up there is no user frame to point at: the warning names the variable instead
        warnings.warn_explicit(
            f"grpo_patches: {FRAMEWORKS_ENV}={raw!r}: " + "; ".join(problems), GrpoPatchesWarning,
            filename=f"<start-up: {FRAMEWORKS_ENV}={raw}>", lineno=0, module="grpo_patches.startup")
    return enabled


try:
    run()
except Exception as _exc:  # never break an interpreter's start-up
    import sys

    print(f"grpo_patches: start-up patching failed: {_exc!r}", file=sys.stderr)
