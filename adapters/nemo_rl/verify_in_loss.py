"""Verify mode's measurements inside NeMo-RL's loss calls of a verified global batch
(:mod:`.verify`; called by :mod:`.loss_call`)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from grpo_patches import verify

from .calls import loss_mask
from .placeholders import first_rows
from .state import current_train


def measure_prev(call: Mapping[str, Any]) -> None:
    """In a loss call of a verified global batch whose prev-logprob pass was skipped: the largest
    ``|current - prev|`` over its loss tokens (``prev_logprobs`` holds the real pass then)."""
    train = current_train()
    if train is None or train.prev_diff is None:
        return
    data, current = call["data"], call["next_token_logprobs"]
    mask = loss_mask(data)
    first = first_rows(data)  # a deferred pass: only the first optimizer step's rows used current log-probs
    if first is not None:
        mask = mask * first.to(mask.device, mask.dtype).unsqueeze(-1)
    prev = data["prev_logprobs"][:, 1:].to(current.device)
    width = min(int(current.shape[1]), int(prev.shape[1]))
    measured = verify.max_abs_diff(current.detach()[:, :width], prev[:, :width], mask[:, :width].to(current.device))
    train.prev_diff = max(train.prev_diff, measured)


def measure_reference(loss: Callable[..., Any], call: Mapping[str, Any]) -> None:
    """In a loss call of a verified global batch whose reference pass was skipped (its
    log-probs are a zero placeholder): the loss with the placeholder against the loss with
    other values in its place (the detached current log-probs), without autograd. A loss that
    does not read them (KL penalty 0) gives exactly the same value."""
    train = current_train()
    if train is None or train.reference_diff is None or "reference_policy_logprobs" not in call["data"]:
        return
    import torch

    data, current = call["data"], call["next_token_logprobs"].detach()
    other = type(data)(data)
    values = torch.zeros(data["reference_policy_logprobs"].shape, dtype=current.dtype, device=current.device)
    values[:, 1:] = current[:, : values.shape[1] - 1]
    other["reference_policy_logprobs"] = values.to(data["reference_policy_logprobs"].dtype)
    with torch.no_grad():
        without = loss(**{**call, "next_token_logprobs": current})[0]
        with_values = loss(**{**call, "next_token_logprobs": current, "data": other})[0]
    train.reference_diff = max(train.reference_diff, verify.max_abs_diff(with_values, without))
