"""Whether the reference-policy log-prob pass can be skipped, with the reason.

Framework-free: the adapters collect the coefficients, this module only decides. The
reference pass (and the reference model) is needed only by a KL term with a non-zero
coefficient, or by a KL metric the user asked for. The old-policy pass is decided elsewhere
(:mod:`grpo_patches.recompute`, through the ``grpo_recompute_old_logps`` hook).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from grpo_patches.errors import OptionError

__all__ = ["ReferencePassDecision", "decide_reference_pass"]


@dataclass(frozen=True)
class ReferencePassDecision:
    """The decision and why (the reason names the values; it goes into ``status()``).

    :ivar skip: the reference log-prob pass (and the reference model) is not needed.
    :ivar reason: why it is skipped or kept.
    """

    skip: bool
    reason: str


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


def decide_reference_pass(*, kl_coefficients: Mapping[str, float], kl_metrics_requested: bool) -> ReferencePassDecision:
    """Skip the reference pass iff every KL coefficient is 0 and no KL metric is requested.

    :param kl_coefficients: every coefficient that consumes reference log-probs, named as the
        framework names them; an empty mapping means the config has no KL term.
    :param kl_metrics_requested: the user asked for KL metrics; the reference pass then runs.
    :raises OptionError: (a ``ValueError``) for a non-finite, negative or non-numeric
        coefficient, or a flag that is not a bool.
    """
    coefficients = _check_coefficients(kl_coefficients)
    metrics = _check_flag("kl_metrics_requested", kl_metrics_requested)
    nonzero = {name: value for name, value in coefficients.items() if value != 0.0}
    if nonzero:
        return ReferencePassDecision(False, f"{_format(nonzero)} non-zero: the KL term needs reference log-probs")
    values = _format(coefficients) if coefficients else "no KL coefficient (no KL term)"
    if metrics:
        return ReferencePassDecision(False, f"{values} but a KL metric was requested: the reference pass runs for it")
    return ReferencePassDecision(True, f"{values} and no KL metric requested")
