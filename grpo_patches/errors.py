"""Exceptions and warnings. Every message names the option, version or target and the fix."""

from __future__ import annotations


class GrpoPatchesError(Exception):
    """Base class of every error grpo_patches raises."""


class OptionError(GrpoPatchesError, ValueError):
    """An unknown option, or a value an option does not accept."""


class UnknownFrameworkError(GrpoPatchesError, ValueError):
    """A framework name that has no adapter."""


class UnsupportedFrameworkError(GrpoPatchesError):
    """The framework is missing, outside the supported range, or a patch target has moved."""


class IncompatibleOptionsError(GrpoPatchesError, ValueError):
    """A framework setting that makes an optimization inexact (e.g. the filter with beta != 0)."""


class GrpoPatchesWarning(UserWarning):
    """Something was switched off or ignored; the message says what and why."""


class ExactnessError(GrpoPatchesError, RuntimeError):
    """Verify mode found an optimization whose result differs from the unpatched computation.

    :ivar framework: the adapter (``"trl"``, ``"verl"``, ``"nemo_rl"``).
    :ivar optimizations: the option names whose work the compared computation changed.
    :ivar step: the optimizer step (0-based, as the adapter counts them) that was verified.
    :ivar quantity: what was compared (``"grad_rel_diff"``, ``"old_logprob_max_abs_diff"``, ...).
    :ivar measured: the difference, agreed over the data-parallel ranks (their maximum).
    :ivar tolerance: the largest accepted difference.
    """

    def __init__(self, framework: str, optimizations: tuple[str, ...], step: int, quantity: str,
                 measured: float, tolerance: float, detail: str = "") -> None:
        self.framework, self.optimizations, self.step = framework, tuple(optimizations), step
        self.quantity, self.measured, self.tolerance, self.detail = quantity, measured, tolerance, detail
        names = ", ".join(self.optimizations)
        super().__init__(
            f"grpo_patches verify: {framework} step {step}: {names} changed the result: {quantity} = {measured:.3e} "
            f"> tolerance {tolerance:.3e}{f' ({detail})' if detail else ''}. The run was stopped before this step's "
            f"update. Pass verify_action='disable' to continue without {names}, or {names.split(', ')[0]}=False, "
            "and please report it with grpo_patches.status()"
        )

    def __reduce__(self) -> tuple:
        # rebuilt from its fields, not its message: it crosses processes (NeMo-RL's Ray workers raise it)
        return (type(self), (self.framework, self.optimizations, self.step, self.quantity, self.measured,
                             self.tolerance, self.detail))


class PlaceholderError(GrpoPatchesError, RuntimeError):
    """A placeholder standing in for a skipped pass reached a loss that would read it.

    Placeholders (e.g. the old log-probs of rows the deferred pass left out) are NaN and never
    readable: the adapter replaces them where no gradient can come of them and raises this
    where one would."""


class HookContractError(GrpoPatchesError, TypeError):
    """A plugin's answer to a decision hook breaks the hook's documented contract (the message names
    the plugin and the rule): :mod:`grpo_patches.hook_contracts`."""
