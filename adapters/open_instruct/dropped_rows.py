"""The forward of a micro-batch the zero-advantage filter drops (``forward_for_logprobs``).

A dropped micro-step gets no forward (``dropped_rows_metrics=False``: log-probs of zeros) or a
no-grad one (``True``: its real log-probs, so that every metric keeps its exact value), returned as
a leaf that requires grad: open-instruct then computes the micro-batch's loss as usual (exactly 0:
every response token has advantage 0, :mod:`.loss_modes`), its backward reaches no parameter
(OLMo-core's ``loss.backward()`` runs on it; DeepSpeed's ``backward`` is skipped,
:mod:`.zero_advantage_deepspeed`), and metrics that need its forward are renamed (:mod:`.metrics`).
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import bind

from . import FRAMEWORK, steps, verify
from .state import FORWARD


def forward_for_logprobs(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``grpo_utils.forward_for_logprobs``: a dropped micro-step runs no training forward."""
    import torch

    call_args = bind(wrapped, args, kwargs)
    model, query_responses = call_args["model"], call_args["query_responses"]
    with FORWARD.joined(lambda: steps.forward_call(model, query_responses)) as call:
        step = call.step
        if not call.training or call.current is None or step.plan is None:
            return wrapped(*args, **kwargs)
        if call.current.s in step.plan.would_drop:  # verify mode: it runs; its loss's gradient must be 0
            logps, entropy = wrapped(*args, **kwargs)
            verify.record_dropped_gradient(step, step.group_of(call.current.s), logps)
            return logps, entropy
        if not step.plan.dropped(call.current.s):
            return wrapped(*args, **kwargs)
        rows = int(query_responses.shape[0])
        if FRAMEWORK.setting("dropped_rows_metrics", False):
            with torch.no_grad():
                logps, entropy = wrapped(*args, **kwargs)
            step.add(dropped_no_grad_forwards=1)
        else:
            shape = (rows, int(query_responses.shape[1]) - 1)
            dtype = call.learner.head_dtype(model)
            logps = torch.zeros(shape, dtype=dtype, device=query_responses.device)
            entropy = torch.zeros_like(logps) if call_args["return_entropy"] else None
        tokens = int(step.data.response_masks[call.current.i][:, 1:].sum())
        step.add(micro_batches_dropped=1, rows_dropped=rows, tokens_dropped=tokens)
        FRAMEWORK.report_savings(micro_batches_dropped=1, rows_dropped=rows, tokens_dropped=tokens)
        return logps.detach().requires_grad_(True), entropy
