"""One policy for an optimization that cannot reproduce a configuration exactly.

Asked for explicitly (``option=True``), the optimization refuses the configuration with one
:class:`~grpo_patches.errors.IncompatibleOptionsError` before training; otherwise (``"auto"``,
an option on by default, or ``enable("all")``) it switches itself off and ``status()`` says
why. Every adapter decides through :func:`refuse_or_note`, so the error and the note read
the same in every framework, and no adapter builds the error itself.
"""

from __future__ import annotations

from typing import Any, Sequence

from grpo_patches import api
from grpo_patches.errors import IncompatibleOptionsError

__all__ = ["refuse_or_note"]


def refuse_or_note(framework: str, option: str, reasons: str | Sequence[str], owner: Any = None) -> bool:
    """Refuse (``option=True``) or note (otherwise) that ``option`` cannot run exactly.

    The note goes under ``status()[framework]`` (per ``owner``'s class when given), keyed by
    ``option``, as ``"off: <reasons>"``.

    :param framework: the adapter deciding (``"trl"``).
    :param option: the :class:`~grpo_patches.options.Options` field (``"tiled_loss"``).
    :param reasons: what about the configuration the optimization cannot reproduce, each
        naming the setting (and its fix where there is one); several are joined with ``"; "``.
    :param owner: the framework object or class the decision is about
        (see :func:`grpo_patches.api.note`).
    :return: ``False`` (the optimization is off), so a decision can ``return refuse_or_note(...)``.
    :raises IncompatibleOptionsError: ``option`` is ``True`` (``verify_every``: set), and not
        enabled through ``"all"``.
    """
    text = reasons if isinstance(reasons, str) else "; ".join(reasons)
    if api.strict(framework, option):
        if option == "verify_every":  # a step count, not a switch: verification never goes unchecked silently
            raise IncompatibleOptionsError(
                f"{option}={api.active_options(framework).verify_every}: {text}. To train without verification "
                f"there, pass {option}=None to grpo_patches.enable({framework!r}, ...) (GRPO_PATCHES_OPTIONS)")
        raise IncompatibleOptionsError(
            f"{option}=True: {text}. To train without it, pass {option}='auto' (off, with the reason in "
            f"grpo_patches.status()) or {option}=False to grpo_patches.enable({framework!r}, ...)"
        )
    api.note(framework, option, f"off: {text}", owner=owner)
    return False
