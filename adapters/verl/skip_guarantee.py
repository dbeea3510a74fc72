"""When the trainer may skip the old-logprob pass, and the proof afterwards that it was right to.

The trainer (the driver, or verl's ``TaskRunner`` actor) and the processes that update the
actor (Ray workers) are patched separately: ``GRPO_PATCHES=verl`` reaches a worker only through
its environment, and a worker may run with other options or without grpo_patches. A skipped
pass leaves a placeholder (:mod:`.placeholders`) that only a patched worker replaces, so:

1. :func:`workers_substitute` (once per trainer): the pass is skipped only when every process
   that runs the actor's update has the verl adapter on with ``logprob_skip`` and every
   worker-side record of it applied. It asks them: a Ray worker group's actors are probed
   through Ray's ``__ray_call__`` (the function runs in the worker process); a worker group
   without Ray actors (an in-process stand-in) runs its actor here, so this process is asked.
   Anything else (no answer, an older Ray): the pass runs, with the reason in ``status()``.
2. :func:`expect_substitution` / :func:`confirm` (the trainers' ``_update_actor`` wrappers,
   :func:`.old_logprobs.update_actor`, :func:`.old_logprobs_v1.update_actor`): the update that follows a
   skipped pass must report ``grpo_patches/old_log_probs_substituted`` in verl's metrics (the
   worker's substitution says so); if it does not, the run stops with
   :class:`~.placeholders.PlaceholderError`. A worker without grpo_patches gets a NaN loss from
   the placeholder, and verl skips that optimizer step (non-finite grad norm): nothing was
   trained on it, and the run stops here.
3. The same wrappers adopt the options verify mode switched off in the workers
   (``grpo_patches/verify/switched_off/<option>`` in the update's metrics: :mod:`.verify`), so
   the trainer stops skipping the pass from the next step on.
"""

from __future__ import annotations

from typing import Any, Callable

from . import FRAMEWORK, state
from .placeholders import FIX, PlaceholderError
from .verify import adopt_switch_offs

#: The metric the worker's substitution reports (verl's trainer may prefix it with ``actor/``).
SUBSTITUTED = "grpo_patches/old_log_probs_substituted"
#: The trainer's metric of a skipped pass (logged with the update that followed it).
SKIPPED = "grpo_patches/old_logprob_passes_skipped"
#: The modules whose records run in the process that updates the actor.
WORKER_MODULES = ("verl.workers.actor.dp_actor", "verl.workers.engine.fsdp.transformer_impl",
                  "verl.workers.engine_workers", "verl.workers.utils.losses")
#: The legacy Megatron worker's (0.7.x: :mod:`.old_logprobs_megatron_legacy`).
MEGATRON_WORKER_MODULES = ("verl.workers.actor.megatron_actor", "verl.workers.megatron_workers")


def worker_ready(option: str = "logprob_skip") -> str | None:
    """In a process that updates the actor: ``None`` when it substitutes skipped old log-probs
    (the whole pass's with ``logprob_skip``, skipped rows' with ``recompute``), else why not."""
    import grpo_patches

    verl = grpo_patches.status()[FRAMEWORK.name]
    where = verl["process"]
    options = verl.get("options")
    if not verl.get("patched") or options is None:
        return f"the verl adapter is not enabled in the worker ({where}): set GRPO_PATCHES=verl for every Ray worker"
    if not options.get(option):
        return f"{option} is off in the worker ({where})"
    import sys

    # the worker modules this process runs (an FSDP worker never imports the Megatron ones, and vice versa)
    modules = [m for m in (*WORKER_MODULES, *MEGATRON_WORKER_MODULES) if m in sys.modules]
    rows = [r for r in verl.get("patches", []) if r["target"].partition(":")[0] in modules
            and r["option"] in (option, None)]
    missing = sorted({r["target"] for r in rows if r["state"] != "applied"})
    if not rows or missing:
        return f"the worker's substitution is not in place ({where}: {', '.join(missing) or 'no records'})"
    return None


def _probe(actor: Any) -> str | None:
    """Run in a Ray worker by ``__ray_call__`` (``actor``: the worker object, unused)."""
    return worker_ready()


def _probe_rows(actor: Any) -> str | None:
    """:func:`_probe` for the minimal pass's row substitution (option ``recompute``)."""
    return worker_ready("recompute")


def workers_substitute(trainer: Any) -> str | None:
    """``None`` when every process that updates ``trainer``'s actor substitutes, else why not (cached)."""
    own = state.trainer(trainer)
    if own.workers is state.NOT_ASKED:
        own.workers = _ask(getattr(trainer, "actor_rollout_wg", None), _probe)
    return own.workers


def workers_substitute_rows(trainer: Any) -> str | None:
    """:func:`workers_substitute` for skipped rows (the minimal pass, option ``recompute``; cached)."""
    own = state.trainer(trainer)
    if own.rows_workers is state.NOT_ASKED:
        own.rows_workers = _ask(getattr(trainer, "actor_rollout_wg", None), _probe_rows)
    return own.rows_workers


def _ask(group: Any, probe: Callable[[Any], str | None] = _probe) -> str | None:
    handles = list(getattr(group, "workers", None) or [])
    if not handles:  # no Ray actors: the group runs the actor in this process
        return probe(None)
    try:
        import ray

        answers = ray.get([h.__ray_call__.remote(probe) for h in handles], timeout=120)
    except Exception as exc:  # noqa: BLE001  (any failure: the pass runs)
        return f"could not ask the actor's Ray workers whether they substitute ({type(exc).__name__}: {exc})"
    problems = sorted({a for a in answers if a is not None})
    return "; ".join(problems) if problems else None


def expect_substitution(trainer: Any, what: str = "pass") -> None:
    """The next actor update must confirm the substitution: of a skipped ``"pass"`` (counted as
    ``old_logprob_passes_skipped``) or of skipped ``"rows"`` (the minimal pass counts its own)."""
    state.trainer(trainer).pending = what


def _confirmed(metrics: dict) -> bool:
    for name, value in (metrics or {}).items():
        if name.endswith(SUBSTITUTED):
            values = value if isinstance(value, (list, tuple)) else [value]
            if values and all(float(v) > 0 for v in values):
                return True
    return False


def take_expected(trainer: Any) -> str | bool:
    """What the next actor update of ``trainer`` must confirm (:func:`expect_substitution`), taken off it."""
    own = state.trainer(trainer)
    expected, own.pending = own.pending, False
    return expected


def confirm(expected: str | bool, metrics: dict | None) -> None:
    """After an actor update (its ``metrics`` as the trainer gets them): adopt verify mode's switch-offs
    in the workers, stop the run if a substitution ``expected`` is not confirmed, count a skipped pass.

    :raises PlaceholderError: the update did not report the substitution.
    """
    adopt_switch_offs(metrics)  # verify mode's "disable" in the workers reaches the trainer here
    if expected and not _confirmed(metrics):
        raise PlaceholderError(
            "grpo_patches: the trainer skipped the old-logprob pass, but the actor update did not report "
            f"substituting the current log-probs ({SUBSTITUTED} missing from its metrics): a worker is not "
            "patched the way the trainer is. verl skipped that optimizer step (its loss was NaN). Run every "
            f"Ray worker with GRPO_PATCHES=verl and the same options, or {FIX}"
        )
    if expected == "pass" and metrics is not None:  # the saving, in verl's own metrics (the trainer logs them)
        metrics[SKIPPED] = 1.0
