"""The recompute decision: does a fresh rollout need old-policy log-probs?

A rollout is generated with the current weights and then consumed by a few micro-steps.
Old log-probs equal the detached current log-probs at every consumption exactly when no
optimizer step happens between the generation and the rollout's last consumption. The
optimizer steps right after the last micro-step of the current gradient-accumulation
window, so the rollout goes stale exactly when it has more consumptions left than the
window has micro-steps left. Framework-free: adapters count both numbers (the TRL adapter's
``schedule`` module models how TRL and the HF Trainer lay out micro-steps).
"""

from __future__ import annotations

__all__ = ["needs_old_logps", "explain", "window_steps_left", "cap_consumptions", "require_count"]


def require_count(name: str, value: object, minimum: int = 1, hint: str = "") -> int:
    """``value`` when it is an int >= ``minimum`` (a count of steps), else a ``ValueError``
    naming ``name`` (``hint`` is appended to the too-small message)."""
    # bool is an int subclass; True passed as a count is almost surely a mixed-up argument.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.{hint}")
    return value


def needs_old_logps(consumptions_left: int, window_steps_left: int, needed_elsewhere: bool) -> bool:
    """Return ``True`` when the rollout needs old log-probs computed at generation time.

    :param consumptions_left: micro-steps, counting the current one, that will consume the
        rollout (capped at the micro-steps left in training, see :func:`cap_consumptions`).
    :param window_steps_left: micro-steps, counting the current one, left in the current
        gradient-accumulation window (see :func:`window_steps_left`).
    :param needed_elsewhere: something besides the policy ratio (an importance-sampling
        correction against the generator, a log-prob mismatch threshold) consumes the
        trainer's old log-probs whatever the schedule.
    :raises ValueError: a count that is not an int >= 1, or a non-bool flag.
    """
    hint = " Count micro-steps including the current one."
    require_count("consumptions_left", consumptions_left, hint=hint)
    require_count("window_steps_left", window_steps_left, hint=hint)
    if not isinstance(needed_elsewhere, bool):
        raise ValueError(f"needed_elsewhere must be a bool, got {needed_elsewhere!r}.")
    # The optimizer steps after the window's last micro-step: stale iff a consumption follows it.
    return needed_elsewhere or consumptions_left > window_steps_left


def explain(compute: bool, consumptions_left: int, window_steps_left: int, needed_elsewhere: bool) -> str:
    """Why a rollout's old log-probs were computed or not, for ``status()`` notes.

    ``compute`` is the decision taken (the hook's answer); when it differs from
    :func:`needs_old_logps`, the reason says a plugin decided.
    """
    default = needs_old_logps(consumptions_left, window_steps_left, needed_elsewhere)
    facts = f"consumptions_left={consumptions_left}, window_steps_left={window_steps_left}"
    if compute != default:
        return f"{'computed' if compute else 'skipped'}: a grpo_recompute_old_logps plugin decided ({facts})"
    if not compute:
        return f"skipped: on-policy, every consumption is in the generating window ({facts})"
    if needed_elsewhere:
        return f"computed: needed besides the ratio (importance sampling or a log-prob threshold; {facts})"
    return f"computed: an optimizer step happens before the last consumption ({facts})"


def window_steps_left(micro_index_in_window: int, window_length: int) -> int:
    """Micro-steps left in the window, counting the current one.

    :param micro_index_in_window: 0-based index of the current micro-step in its window.
    :param window_length: the window's real length (the HF Trainer's
        ``current_gradient_accumulation_steps``: shorter than ``gradient_accumulation_steps``
        for the last window of an epoch).
    """
    require_count("window_length", window_length)
    require_count("micro_index_in_window", micro_index_in_window, minimum=0)
    if micro_index_in_window >= window_length:
        raise ValueError(
            f"micro_index_in_window={micro_index_in_window} must be < window_length={window_length}; "
            "reset the index when a new accumulation window begins."
        )
    return window_length - micro_index_in_window


def cap_consumptions(per_rollout: int, micro_steps_left_in_training: int) -> int:
    """Consumptions that will really happen: no micro-step runs after training ends.

    :param per_rollout: micro-steps that would consume the rollout in an endless run
        (TRL: ``steps_per_generation * num_iterations`` minus the micro-steps already past).
    :param micro_steps_left_in_training: micro-steps left, counting the current one.
    """
    require_count("per_rollout", per_rollout)
    require_count("micro_steps_left_in_training", micro_steps_left_in_training)
    return min(per_rollout, micro_steps_left_in_training)
