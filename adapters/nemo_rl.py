"""nemo_rl adapter: declared, no patch targets yet (status reports it as not supported)."""

from __future__ import annotations

from grpo_patches.adapter import Adapter

ADAPTER = Adapter(
    name="nemo_rl",
    distribution="nemo-rl",
    supported=">=0.7.0",
    trigger_module="nemo_rl.algorithms.grpo",
    targets=lambda version: [],
    description="adapter not implemented yet (see ../shared/notes/frameworks.md)",
)
