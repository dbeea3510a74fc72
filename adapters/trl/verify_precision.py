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
