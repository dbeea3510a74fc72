"""Which extra log-prob passes of a GRPO step can be skipped, with a reason for each decision.

Framework-free: the adapters collect the coefficients and flags, this module only decides.
The reference pass is needed only by a KL term (or a KL metric the user asked for); the
old-policy pass only when the weights may have moved between generation and consumption or
an importance-sampling correction needs trainer log-probs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from grpo_patches.errors import OptionError

__all__ = ["LogprobPassPlan", "plan_logprob_passes"]


@dataclass(frozen=True)
class LogprobPassPlan:
    """The decision for one step: which passes to skip and why (reasons are for logs/status).

    :ivar skip_reference: the reference-policy log-prob pass is not needed.
    :ivar skip_old: the old-policy log-prob pass is not needed (use the detached current
        log-probs as old ones, which is exact when the step is on-policy).
    :ivar reference_reason: why the reference pass is skipped or kept, naming the values.
    :ivar old_reason: why the old-logprob pass is skipped or kept, naming the values.
    """

    skip_reference: bool
    skip_old: bool
    reference_reason: str
    old_reason: str

    @property
    def skipped(self) -> tuple[str, ...]:
        """Names of the skipped passes, in a fixed order: ``"reference"`` then ``"old"``."""
        return tuple(name for name, skip in (("reference", self.skip_reference), ("old", self.skip_old)) if skip)


def _check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise OptionError(f"{name} must be True or False, got {value!r}")
    return value


def _check_coefficients(kl_coefficients: Any) -> dict[str, float]:
    """Return the coefficients as floats; reject non-finite, negative or non-numeric values."""
    if not isinstance(kl_coefficients, Mapping):
        raise OptionError(
            f"kl_coefficients must be a mapping of coefficient name to value (e.g. {{'beta': 0.0}}), "
            f"got {type(kl_coefficients).__name__}"
        )
    checked: dict[str, float] = {}
    for name, value in kl_coefficients.items():
        if not isinstance(name, str) or not name:
            raise OptionError(f"kl_coefficients keys must be non-empty option names, got {name!r}")
        # bool is an int subclass: True as a coefficient is almost surely a config mix-up
        if isinstance(value, (bool, str, bytes)):
            raise OptionError(f"KL coefficient {name!r} must be a number, got {value!r}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise OptionError(f"KL coefficient {name!r} must be a number, got {value!r}") from None
        if not math.isfinite(number) or number < 0:
            raise OptionError(
                f"KL coefficient {name!r} must be finite and >= 0, got {number!r}; "
                f"set {name}=0 to drop the KL term or a positive value to keep it"
            )
        checked[name] = number
    return checked


def _format(coefficients: Mapping[str, float]) -> str:
    return ", ".join(f"{name}={value!r}" for name, value in coefficients.items())


def _reference_decision(coefficients: Mapping[str, float], kl_metrics_requested: bool) -> tuple[bool, str]:
    nonzero = {name: value for name, value in coefficients.items() if value != 0.0}
    if nonzero:
        return False, f"{_format(nonzero)} non-zero: the KL term needs reference log-probs"
    values = _format(coefficients) if coefficients else "no KL coefficient (no KL term)"
    if kl_metrics_requested:
        return False, f"{values} but a KL metric was requested: the reference pass runs for it"
    return True, f"{values} and no KL metric requested"


def _old_decision(optimizer_step_before_consumption: bool, importance_sampling: bool) -> tuple[bool, str]:
    reasons = []
    if optimizer_step_before_consumption:
        reasons.append("an optimizer step happens between generation and consumption (off-policy)")
    if importance_sampling:
        reasons.append("the importance-sampling correction needs trainer log-probs")
    if reasons:
        return False, "; ".join(reasons)
    return True, (
        "on-policy: optimizer_step_before_consumption=False and importance_sampling=False, "
        "so old log-probs equal the detached current ones"
    )


def plan_logprob_passes(
    *,
    kl_coefficients: Mapping[str, float],
    kl_metrics_requested: bool,
    optimizer_step_before_consumption: bool,
    importance_sampling: bool,
) -> LogprobPassPlan:
    """Plan which log-prob passes of this step can be skipped.

    :param kl_coefficients: every coefficient that consumes reference log-probs, named as the
        framework names them; an empty mapping means the config has no KL term.
    :param kl_metrics_requested: the user asked for KL metrics; the reference pass then runs.
    :param optimizer_step_before_consumption: the weights may change between generation and
        some consumption of this batch.
    :param importance_sampling: an importance-sampling correction against the generator is on.
    :raises OptionError: (a ``ValueError``) for a non-finite, negative or non-numeric
        coefficient, or a flag that is not a bool.
    """
    coefficients = _check_coefficients(kl_coefficients)
    metrics = _check_flag("kl_metrics_requested", kl_metrics_requested)
    stepped = _check_flag("optimizer_step_before_consumption", optimizer_step_before_consumption)
    sampling = _check_flag("importance_sampling", importance_sampling)
    skip_reference, reference_reason = _reference_decision(coefficients, metrics)
    skip_old, old_reason = _old_decision(stepped, sampling)
    return LogprobPassPlan(skip_reference, skip_old, reference_reason, old_reason)
