"""One test run's precision never leaks into the next (the test helper's isolation).

transformers < 5 stores a bf16 config's precision in ``ACCELERATE_MIXED_PRECISION``; a later
``bf16=False`` config in the same process inherited it and autocast to bf16. That made an fp32
exactness test (``test_trl_trim``) compare two bf16 runs and fail at 2e-3 on TRL 0.20, only when
run after another TRL test.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("trl")

from grpo_patches_testing.trl_train import train  # noqa: E402


def test_an_fp32_run_after_a_bf16_run_is_fp32():
    seen: list[str] = []
    before = os.environ.get("ACCELERATE_MIXED_PRECISION")
    record = lambda trainer: seen.append(trainer.accelerator.mixed_precision)  # noqa: E731
    train(False, steps=1, bf16=True, trainer_hook=record)
    train(False, steps=1, bf16=False, trainer_hook=record)
    assert seen == ["bf16", "no"]
    assert os.environ.get("ACCELERATE_MIXED_PRECISION") == before
