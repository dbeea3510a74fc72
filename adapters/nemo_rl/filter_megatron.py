"""The zero-advantage filter in NeMo-RL's Megatron policy worker: not covered yet, never silently.

``MegatronPolicyWorker(Impl).train`` (v0.5.0: ``MegatronPolicyWorker``; v0.6.0+:
``MegatronPolicyWorkerImpl``) runs NeMo-RL's own micro-batches: no filter record of the DTensor
worker reaches it. For a policy-gradient train call with the filter asked for, ``"auto"`` says
so in this worker's ``status()``; ``True`` raises one clear error before the first backward
(compat/README.md, "NeMo-RL's Megatron worker", says what a filter there needs).
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches import api
from grpo_patches.errors import IncompatibleOptionsError

from .calls import arguments
from .state import FRAMEWORK

WHY = ("NeMo-RL's Megatron policy worker (policy.megatron_cfg.enabled=true) is not covered by the zero-advantage "
       "filter yet; it trains on every row")


def train_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``train(data, loss_fn, eval_mode=False, ...)`` of the Megatron worker: a note (``"auto"``) or an error."""
    options = api.active_options(FRAMEWORK)
    call = arguments(wrapped, args, kwargs)
    policy_gradient = type(call["loss_fn"]).__name__ == "ClippedPGLossFn" and "advantages" in call["data"]
    if options is not None and options.zero_advantage_filter is not False and policy_gradient \
            and not call["eval_mode"]:
        # refuse-or-note
        if api.strict(FRAMEWORK, "zero_advantage_filter"):
            raise IncompatibleOptionsError(f"zero_advantage_filter=True: {WHY}. Use the DTensor worker or pass "
                                           "zero_advantage_filter=False (or 'auto') in GRPO_PATCHES_OPTIONS")
        api.note(FRAMEWORK, "zero_advantage_filter", f"off: {WHY}", owner=instance)
    return wrapped(*args, **kwargs)
