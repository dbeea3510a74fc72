"""The ``GRPOConfig`` every tiny TRL run here starts from: the demo's and the tests' (through
:mod:`grpo_patches_testing.trl_train`), which add their own completion length and learning rate.

4 prompts x 4 generations per micro-batch, ``gradient_accumulation_steps=3`` with
``steps_per_generation=2``: misaligned, so upstream TRL recomputes old log-probs on every
rollout and the recompute decision has work to save; ``beta=0`` (no reference pass); CPU,
fixed seed, no checkpoints, no reporting.
"""

from __future__ import annotations

from typing import Any

BASE_CONFIG: dict[str, Any] = dict(
    per_device_train_batch_size=4,
    num_generations=4,
    gradient_accumulation_steps=3,
    steps_per_generation=2,
    beta=0.0,
    logging_steps=1,
    save_strategy="no",
    seed=0,
    use_cpu=True,
    report_to="none",
    disable_tqdm=True,
)
