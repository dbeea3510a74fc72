"""TRL's log-prob method run by the adapter itself, as TRL runs its old-logprob pass.

Two callers: the pass deferred to the rows the zero-advantage filter keeps
(:mod:`.old_logprob_rows`) and, in verify mode, the pass over every row that the patches skipped
or deferred (:mod:`.verify_rollout`). Both use TRL's own method and the arguments of TRL's own
call, without gradients and without gradient checkpointing, like TRL's pass.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from typing import Any, Callable, Mapping

from . import GRPO_MODULE
from .row_subsets import rows_of


def no_checkpointing(trainer: Any) -> Any:
    """TRL's context that runs a no-grad forward without gradient checkpointing (if it has one)."""
    disable: Callable[..., Any] | None = getattr(sys.modules.get(GRPO_MODULE), "disable_gradient_checkpointing", None)
    if disable is None:
        return nullcontext()
    return disable(trainer.model, trainer.args.gradient_checkpointing_kwargs)


def run(trainer: Any, method: Callable[..., Any], arguments: Mapping[str, Any], rows: Any = None) -> tuple:
    """``method(**arguments)`` on ``rows`` (a LongTensor; ``None``: every row), no gradients.

    :param method: TRL's ``_get_per_token_logps_and_entropies`` (bound, or the original a
        wrapper received: it then runs without the adapter's routing).
    :param arguments: the arguments of TRL's old-logprob call, as bound by the routing wrapper.
    """
    import torch

    chosen = dict(arguments) if rows is None else rows_of(arguments, rows, method)
    with torch.no_grad(), no_checkpointing(trainer):
        return tuple(method(**chosen))
