"""TRL loss-path patches (zero-advantage filter, tiled lm-head loss). Stub until filled."""

from __future__ import annotations

from packaging.version import Version

from grpo_patches.patching import PatchTarget


def loss_targets(version: Version) -> list[PatchTarget]:
    """Patch records for GRPOTrainer's loss computation at ``version``."""
    return []
