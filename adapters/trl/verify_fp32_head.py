"""Verify mode's fp32-head reference in TRL's own chunked log-prob kernel (:mod:`grpo_patches.verify_fp32_head`).

TRL 1.16 never calls its lm-head module in the loss: ``add_fused_lm_head``'s forward hands the
last hidden state and the head's weight to ``ChunkedLogProbFunction``, which computes each tile
in the autocast dtype or the hidden state's (bf16 weights: bf16 logits). Within the reference (a
verify step's extra run of TRL's unpatched loss over bf16 weights, :meth:`.verify.MicroStep.head_reference`)
this record calls the kernel's ``forward`` with both in fp32, autocast off; everywhere else it
passes through. autograd casts the fp32 gradients its backward returns to the inputs' dtypes.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches import verify_fp32_head as reference


def chunked_logprob_forward(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``ChunkedLogProbFunction.forward(ctx, hidden, weight, bias, targets, ...)``."""
    return reference.kernel_call(wrapped, args, kwargs, "hidden", "weight", "bias")
