"""The precision verify mode judges a TRL micro-step in (:mod:`grpo_patches.verify_gradients`).

With ``bf16=True`` / ``fp16=True`` and fp32 weights (GRPOConfig's default: autocast), TRL's loss
can be recomputed in fp32 by turning autocast off: the fp32 reference a patched gradient is
judged against. Autocast comes from Accelerate twice: baked into the prepared model's
``forward`` (the plain one kept as ``_original_forward``; inside the DDP / FSDP wrapper) and ``accelerator.autocast()``, which
TRL's log-prob method enters itself; :func:`full_precision` puts the plain ``forward`` in place
and makes the accelerator's context a no-op (``native_amp`` off) for the duration. With bf16 weights there is no fp32 computation without a copy of the model: the
reversed-rows noise floor judges it.

A configuration whose half-precision decisions are discontinuous (:func:`discontinuous`: TRL's
entropy mask, ``top_entropy_quantile < 1``, flips on rounding noise) is judged in fp32 (patched
and unpatched with autocast off) where the weights allow it; otherwise not judged, and
``status()`` says so (:func:`note_unjudged`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from . import FRAMEWORK, verify_rows

#: The ``status()`` note key of a micro-step verify mode could not judge.
NOTE = "verify"


def has_fp32_reference(trainer: Any, model: Any) -> bool:
    """Whether the run autocasts to a half dtype over fp32 trainable weights."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    return verify_rows.is_half(trainer) and next(iter(trainer.model.parameters())).dtype == torch.float32 and \
        bool(params) and all(p.dtype == torch.float32 for p in params)


def discontinuous(trainer: Any) -> str | None:
    """Why the run's half-precision decisions flip on rounding noise (``None``: they do not)."""
    quantile = getattr(trainer.args, "top_entropy_quantile", 1.0)
    if quantile is not None and float(quantile) < 1.0:
        return f"top_entropy_quantile={quantile} (an entropy mask flips on rounding noise)"
    return None


@contextlib.contextmanager
def full_precision(trainer: Any, model: Any) -> Iterator[None]:
    """Autocast off for the duration: the prepared model's and the accelerator's too."""
    import torch

    device = next(iter(model.parameters())).device.type
    while "_original_forward" not in model.__dict__ and hasattr(model, "module"):  # under DDP / FSDP
        model = model.module
    saved, plain = model.__dict__.get("forward"), model.__dict__.get("_original_forward")
    accelerator = getattr(trainer, "accelerator", None)
    amp = getattr(accelerator, "native_amp", None)
    if saved is not None and plain is not None:
        model.forward = plain
    if amp:
        accelerator.native_amp = False
    try:
        with torch.autocast(device_type=device, enabled=False):
            yield
    finally:
        if saved is not None and plain is not None:
            model.forward = saved
        if amp:
            accelerator.native_amp = amp


def note_unjudged(trainer: Any, reason: str) -> None:
    FRAMEWORK.note(NOTE, f"not judged: {reason}, and bf16 weights leave no fp32 computation to judge it in",
                   owner=trainer)


class EntropyMasks:
    """TRL's entropy mask is a quantile of the entropies: where tokens' entropies tie to within
    fp32 rounding (a small model's near-uniform ones do), even fp32 flips it. For the fp32 pair
    the patched computation's masks are recorded (:meth:`recording`) and replayed to TRL's
    (:meth:`replaying`, call by call, same shape), so the gradients are compared under one
    decision; the entropies the two took it from are compared on their own (:meth:`max_abs_diff`).
    Every rank records and replays the same calls (TRL's gather runs in the recording)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer, self.recorded, self.replayed = trainer, [], []

    @contextlib.contextmanager
    def _answering(self, answer: Any) -> Iterator[None]:
        own = self.trainer.get_high_entropy_mask  # the bound method (class attribute)
        self.trainer.get_high_entropy_mask = lambda entropies, mask, threshold: answer(own, entropies, mask,
                                                                                         threshold)
        try:
            yield
        finally:  # (the micro-step's Trace may have taken it back already)
            vars(self.trainer).pop("get_high_entropy_mask", None)

    def recording(self) -> Any:
        def record(own: Any, entropies: Any, mask: Any, threshold: float) -> Any:
            result = own(entropies, mask, threshold)
            self.recorded.append((entropies.detach().clone(), result))
            return result

        return self._answering(record)

    def replaying(self) -> Any:
        def replay(own: Any, entropies: Any, mask: Any, threshold: float) -> Any:
            index = len(self.replayed)
            if index < len(self.recorded) and self.recorded[index][0].shape == entropies.shape:
                self.replayed.append(entropies.detach().clone())
                return self.recorded[index][1]
            return own(entropies, mask, threshold)

        return self._answering(replay)

    def max_abs_diff(self) -> float | None:
        """The largest entropy difference of the replayed calls (``None``: none replayed)."""
        if not self.replayed:
            return None
        return max(float((mine - theirs).abs().max()) if mine.numel() else 0.0
                   for (theirs, _), mine in zip(self.recorded, self.replayed))
