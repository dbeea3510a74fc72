"""The placeholder a skipped old-logprob pass leaves in verl's batch, and the guard that keeps it
out of every loss.

A skipped pass still has to hand verl an ``old_log_probs`` field (verl's stages and its data
transfer expect one). Its value is a NaN no log-prob pass produces (a quiet NaN carrying a
payload of grpo_patches' own), so that it can never be read as log-probs: any arithmetic on it
is NaN, and the payload tells it apart from a NaN of verl's own. Between the trainer and the
loss verl only copies old log-probs (TransferQueue, Ray, padding, slicing: float32 throughout),
which keeps the payload.

* The worker side keys its substitution on what it receives: ``old_log_probs`` that are all
  placeholder (:func:`fills`) are replaced by the detached current log-probs, wherever the
  trainer's stages carried them (the V1 TransferQueue trainer, the legacy ``RayPPOTrainer``);
  no metadata has to survive between stages.
* :func:`get_policy_loss_fn` (every patched worker, whatever the options) raises
  :class:`PlaceholderError` when a placeholder reaches verl's policy loss: unsubstituted, it
  would make the loss NaN, and verl would skip the optimizer step with a warning (a non-finite
  grad norm) instead of training.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.errors import GrpoPatchesError

#: float32 bits of the placeholder: a quiet NaN (exponent all ones, quiet bit set) with payload 0x25_4750.
BITS = 0x7FE54750
#: float32 bits of a row-level placeholder (the minimal pass's skipped rows, :mod:`.old_logprob_rows`):
#: a different payload, so the whole-pass skip's checks never mistake a partly skipped batch for theirs.
ROW_BITS = 0x7FE54751
FIX = "pass logprob_skip=False to grpo_patches.enable(...) (GRPO_PATCHES_OPTIONS=logprob_skip=0)"


class PlaceholderError(GrpoPatchesError, RuntimeError):
    """A skipped pass's placeholder would have been read as log-probs."""


def like(t: Any) -> Any:
    """A float32 placeholder of ``t``'s shape (every element the placeholder NaN)."""
    import torch

    return torch.full(tuple(t.shape), BITS, dtype=torch.int32).view(torch.float32)


def rows_like(t: Any) -> Any:
    """A float32 row-level placeholder of ``t``'s shape (:data:`ROW_BITS` on every element)."""
    import torch

    return torch.full(tuple(t.shape), ROW_BITS, dtype=torch.int32).view(torch.float32)


def _flags(t: Any, bits: int = BITS) -> Any:
    import torch

    values = t.values() if getattr(t, "is_nested", False) else t
    if values.dtype != torch.float32:
        return torch.zeros(values.shape, dtype=torch.bool)  # a float32 placeholder converted: not ours any more
    return values.detach().contiguous().view(torch.int32) == bits


def row_flags(t: Any) -> Any:
    """Where ``t`` holds the row-level placeholder (a bool tensor of ``t``'s shape, or its values')."""
    return _flags(t, ROW_BITS)


def fills(t: Any) -> bool:
    """Whether every element of ``t`` (a nested tensor's values) is the placeholder."""
    flags = _flags(t)
    return bool(flags.numel()) and bool(flags.all())


def present(t: Any) -> bool:
    """Whether any element of ``t`` is the placeholder."""
    return bool(_flags(t).any())


def skipped_pass_batch(data: Any) -> Any | None:
    """``data``, a legacy update call's batch, when its old log-probs are the skipped pass's
    placeholder (``None`` otherwise: the update runs as verl's own)."""
    if data is None or "old_log_probs" not in data.batch.keys() or not present(data.batch["old_log_probs"]):
        return None
    return data


def require_on_policy(data: Any, config: Any, what: str = "this update") -> None:
    """Raise before training unless ``data`` (placeholder old log-probs) is one on-policy update:
    one mini-batch (``config.ppo_mini_batch_size``: this rank's rows), one epoch, no rollout log-probs."""
    old = data.batch["old_log_probs"]
    mini_batches = -(-len(data) // int(config.ppo_mini_batch_size))
    if not fills(old) or mini_batches != 1 or int(config.ppo_epochs) != 1 or config.get("use_rollout_log_probs", False):
        raise PlaceholderError(
            f"grpo_patches: the old-logprob pass was skipped but {what} is not on-policy ({len(data)} rows, "
            f"ppo_mini_batch_size={config.ppo_mini_batch_size}, ppo_epochs={config.ppo_epochs}, old log-probs all "
            f"placeholder: {fills(old)}); nothing was trained. Please report this and {FIX}")


def get_policy_loss_fn(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``get_policy_loss_fn`` (the binding verl's loss calls): the policy loss
    it returns refuses an ``old_log_prob`` holding the placeholder."""
    fn = wrapped(*args, **kwargs)

    def guarded(*a: Any, **kw: Any) -> Any:
        old = kw.get("old_log_prob", a[0] if a else None)
        if old is not None and (present(old) or bool(row_flags(old).any())):
            raise PlaceholderError(
                "grpo_patches: a skipped old-logprob pass's placeholder reached verl's policy loss as the old "
                "log-probs (the trainer skipped the pass, and this update's worker did not substitute the "
                "current log-probs). Nothing was trained on it. Make sure every Ray worker runs with "
                f"GRPO_PATCHES=verl and the same options, or {FIX}"
            )
        return fn(*a, **kw)

    return guarded
