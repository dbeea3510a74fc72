"""Verify mode's fp32-head reference in verl's fused-kernel forward (:mod:`grpo_patches.verify_fp32_head`).

With ``use_fused_kernels`` (the tiled loss's condition) verl's model never calls its lm-head
module: ``FusedLinearForPPO.forward(hidden_states, vocab_weights, ...)`` takes the weight and
rounds the logits to the hidden state's dtype. Within the reference (a verify step's extra run
of verl's unpatched computation: :mod:`.verify_engine`, :mod:`.verify_legacy`) this record, outermost on that method,
calls it with both in fp32, autocast off; everywhere else it passes through.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches import verify_fp32_head as reference


def forward(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``FusedLinearForPPO.forward(hidden_states, vocab_weights, input_ids, temperature)``."""
    return reference.kernel_call(wrapped, args, kwargs, "hidden_states", "vocab_weights")
