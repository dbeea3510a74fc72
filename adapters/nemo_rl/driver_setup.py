"""``grpo.setup`` on the driver: decisions and checks made once, before anything is built.

* The reference model and pass (:mod:`.reference`): decided here through the
  ``grpo_skip_reference_pass`` hook; v0.5.0 / v0.6.0 then build the policy without it.
* The Ray workers get grpo_patches only through the start-up directory (``grpo-patches run``)
  and their options only from ``GRPO_PATCHES_OPTIONS``: options given to ``enable()`` in the
  driver that the workers would not get are an error here, naming the fix.
* ``zero_advantage_filter=True`` / ``tiled_loss=True`` with a loss configuration they cannot
  reproduce exactly raise here (the workers decide again on every train call, from the loss
  object they receive; with ``"auto"`` they switch themselves off and say why).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from grpo_patches.call_args import bind
from grpo_patches.caller_frame import unwrap
from grpo_patches.errors import GrpoPatchesError, OptionError
from grpo_patches.options import Options, parse_env_options
from grpo_patches.startup_path import FRAMEWORKS_ENV, OPTIONS_ENV, STARTUP_DIR_ENV

from . import FRAMEWORK, PACKAGE, reference, version
from .calls import setting
from .loss_modes import gradient_terms
from .state import SETUP, SetupCall
from .tiled_coverage import not_reproduced, unsupported_loss_settings

#: Options that act in the workers (they read them from ``GRPO_PATCHES_OPTIONS``).
WORKER_OPTIONS = ("zero_advantage_filter", "tiled_loss", "tile_size", "dropped_rows_metrics", "verify_every",
                  "verify_action", "verify_tolerance")


def workers_reached(environ: Any = os.environ) -> tuple[bool, str]:
    """Whether Ray workers started from this environment get grpo_patches, and why."""
    names = {n.strip() for n in environ.get(FRAMEWORKS_ENV, "").split(",")}
    if not names & {FRAMEWORK.name, "all"}:
        return False, f"{FRAMEWORKS_ENV} does not name {FRAMEWORK.name}"
    startup = environ.get(STARTUP_DIR_ENV)
    if not startup or startup not in environ.get("PYTHONPATH", "").split(os.pathsep):
        return False, "no grpo_patches start-up directory on PYTHONPATH"
    return True, f"through the start-up directory {startup} on PYTHONPATH"


def check_worker_options(options: Options, environ: Any = os.environ) -> None:
    """Raise if the driver's options for the workers differ from what the workers will read."""
    reached, why = workers_reached(environ)
    if not reached:
        wanted = [o for o in WORKER_OPTIONS if getattr(options, o) not in (False, None)
                  and o not in ("dropped_rows_metrics", "verify_action", "verify_tolerance")]
        FRAMEWORK.note("workers", f"not reached ({why}): the zero-advantage filter and the tiled loss run in the "
                                  "Ray workers only; start the driver with `grpo-patches run -- ...`"
                       + (f" (asked for: {', '.join(wanted)})" if wanted else ""))
        return
    try:
        theirs = Options.from_kwargs(parse_env_options(environ.get(OPTIONS_ENV, "")))
    except GrpoPatchesError as exc:
        raise OptionError(f"{OPTIONS_ENV}: {exc}") from None
    differ = [o for o in WORKER_OPTIONS if getattr(options, o) != getattr(theirs, o)]
    if differ:
        wanted = ",".join(f"{o}={getattr(options, o)}" for o in differ)
        raise OptionError(
            f"grpo_patches.enable({FRAMEWORK.name!r}, ...) in the driver sets {wanted}, but the Ray workers read their "
            f"options from {OPTIONS_ENV}={environ.get(OPTIONS_ENV, '')!r}. Set {OPTIONS_ENV} (e.g. "
            f"`grpo-patches run --options {wanted} -- ...`) or pass the same options to enable()"
        )
    FRAMEWORK.note("workers", f"reached {why}")


def _probe_loss(config: Any, grpo_module: Any) -> Any:
    """The loss object ``setup`` will build (``ClippedPGLossFn(master_config["loss_fn"])``), or
    ``None`` if it cannot be built from this config alone."""
    try:
        return grpo_module.ClippedPGLossFn(setting(config, "loss_fn"))
    except Exception:  # noqa: BLE001 - the workers check the real object anyway
        return None


def check_loss_options(loss_fn: Any) -> None:
    """``True`` options that this loss configuration would make inexact raise now (``refuse_or_note``;
    ``"auto"`` is decided by the workers, from the loss object they receive)."""
    from grpo_patches.zero_advantage import filter_problems

    if FRAMEWORK.strict("zero_advantage_filter"):
        problems = filter_problems(gradient_terms(loss_fn))
        if problems:
            FRAMEWORK.refuse_or_note("zero_advantage_filter", problems)
    if FRAMEWORK.strict("tiled_loss"):
        problems = unsupported_loss_settings(loss_fn)
        if problems:
            FRAMEWORK.refuse_or_note("tiled_loss", not_reproduced(problems))


def setup(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``grpo.setup(master_config, ...)``: the checks, then the call as a :class:`~.state.SetupCall`
    (v0.5 / v0.6: the reference decision, read when the policy is built, :mod:`.reference`)."""
    if not FRAMEWORK.enabled:
        return wrapped(*args, **kwargs)
    config = bind(wrapped, args, kwargs)["master_config"]
    check_worker_options(FRAMEWORK.options)
    probe = _probe_loss(config, sys.modules[unwrap(wrapped).__module__])
    if probe is not None:
        check_loss_options(probe)
    decision = reference.decide(config) if FRAMEWORK.on("logprob_skip") else None
    if version.at_least(PACKAGE, "0.7.0"):
        reference.note_upstream(decision)
        return wrapped(*args, **kwargs)
    if decision is not None and not decision.skip:
        FRAMEWORK.note("reference_pass", f"runs: {decision.reason}")
    with SETUP.entered(SetupCall(reference=decision)):
        return wrapped(*args, **kwargs)
