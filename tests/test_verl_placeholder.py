"""The placeholder a skipped verl old-logprob pass leaves (``adapters/verl/placeholders.py``):
never readable as log-probs, told apart from verl's own NaNs, and refused by the loss guard.
torch only: runs in the main suite."""

from __future__ import annotations

import pytest
import torch

from grpo_patches.adapters.verl import placeholders


def test_the_placeholder_is_a_nan_no_arithmetic_hides():
    old = placeholders.like(torch.ones(3, 5, dtype=torch.long))
    assert old.dtype == torch.float32 and old.shape == (3, 5)
    assert torch.isnan(old).all() and placeholders.fills(old)
    log_prob = torch.randn(3, 5)
    assert torch.isnan(torch.exp(log_prob - old)).all()  # the ratio
    assert torch.isnan(old * 0.0).all()  # a zero weight does not hide it


def test_it_survives_the_copies_between_stages_and_is_told_from_other_nans():
    old = placeholders.like(torch.ones(4, 6))
    nested = torch.nested.nested_tensor_from_jagged(old.flatten()[:10], offsets=torch.tensor([0, 3, 10]))
    assert placeholders.fills(nested)  # TransferQueue's jagged layout
    assert placeholders.fills(torch.cat([old[2:], old[:2]]).clone())
    assert not placeholders.present(torch.full((4, 6), float("nan")))  # verl's own NaN is not ours
    assert not placeholders.present(torch.randn(4, 6)) and not placeholders.fills(torch.empty(0))
    mixed = torch.randn(4, 6)
    mixed[1] = old[1]
    assert placeholders.present(mixed) and not placeholders.fills(mixed)


def test_the_guard_refuses_it_as_old_log_probs():
    calls = []

    def policy_loss(old_log_prob, log_prob, **kwargs):
        calls.append(old_log_prob)
        return (log_prob - old_log_prob).sum(), {}

    guarded = placeholders.get_policy_loss_fn(lambda mode: policy_loss, None, ("vanilla",), {})
    log_prob = torch.randn(2, 3)
    guarded(old_log_prob=log_prob.detach(), log_prob=log_prob)  # real old log-probs pass through
    with pytest.raises(placeholders.PlaceholderError, match="logprob_skip=False"):
        guarded(old_log_prob=placeholders.like(log_prob), log_prob=log_prob)
    with pytest.raises(placeholders.PlaceholderError):
        guarded(placeholders.like(log_prob), log_prob)  # positional, as older callers pass it
    assert len(calls) == 1  # verl's loss never saw the placeholder
