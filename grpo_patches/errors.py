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
