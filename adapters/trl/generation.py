"""The one patch record on ``GRPOTrainer._generate_and_score_completions``.

The recompute decision (option ``recompute``), the old-logprob pass restricted to the rows the
zero-advantage filter keeps (:mod:`.deferred_pass`) and the log-prob pass observer (option
``logprob_skip``) share this wrapper: the observer checks the output of the decided call, and
one wrapper reads the options in force at call time.
Evaluation calls pass straight through: they never use old log-probs.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches import api

from . import deferred_pass
from .reference import observe_logprob_passes
from .old_logprobs import decide_for_trainer, exact_recompute


def generation_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Exact recompute, then the log-prob pass report, for each training rollout."""
    options = api.active_options("trl")
    if options is None or not instance.model.training:
        return wrapped(*args, **kwargs)
    with deferred_pass.deferring(instance) as deferred:
        if options.recompute and decide_for_trainer(instance):
            output = exact_recompute(wrapped, instance, args, kwargs)
        else:
            output = wrapped(*args, **kwargs)
        deferred_pass.complete(instance, deferred, output)
    if options.logprob_skip:
        observe_logprob_passes(instance, output)
    return output
