"""TRL adapter (GRPOTrainer, TRL 0.20 - 1.16). Placeholder until the TRL issue lands."""

from __future__ import annotations

from grpo_patches.adapter import Adapter

ADAPTER = Adapter(
    name="trl",
    distribution="trl",
    supported=">=0.20,<1.17",
    trigger_module="trl.trainer.grpo_trainer",
    targets=lambda version: [],
    description="adapter not implemented yet",
)
