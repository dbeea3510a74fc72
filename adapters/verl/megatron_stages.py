"""Running a wrapper written for the FSDP engine on every stage of verl's Megatron pipeline.

verl's ``MegatronEngine.forward_backward_batch`` returns the update's output (with its
``metrics``) on the last pipeline stage only, and ``{}`` on the others. The FSDP engine's
wrappers edit ``output["metrics"]``; :func:`on_every_stage` lets them run unchanged on every
stage, so that each stage makes the same decisions.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

#: Marks the stand-in output of a pipeline stage that is not the last (verl returns ``{}`` there).
_NOT_LAST_STAGE = "grpo_patches_not_last_stage"


def on_every_stage(engine_wrapper: Callable[..., Any], wrapped: Callable[..., Any], instance: Any, args: tuple,
                   kwargs: dict) -> Any:
    """Run a wrapper written for the FSDP engine's ``forward_backward_batch`` (it edits
    ``output["metrics"]``) on every pipeline stage: the stages before the last return ``{}``."""

    @functools.wraps(wrapped)  # the engine wrapper binds verl's arguments through it
    def run(*a: Any, **kw: Any) -> Any:
        output = wrapped(*a, **kw)
        return output if output else {"metrics": {}, _NOT_LAST_STAGE: True}

    output = engine_wrapper(run, instance, args, kwargs)
    return {} if output.get(_NOT_LAST_STAGE) else output
