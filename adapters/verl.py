"""verl adapter: declared, no patch targets yet (status reports it as not supported)."""

from __future__ import annotations

from grpo_patches.adapter import Adapter

ADAPTER = Adapter(
    name="verl",
    distribution="verl",
    supported=">=0.6.1",
    trigger_module="verl.workers.actor",
    targets=lambda version: [],
    description="adapter not implemented yet (see ../shared/notes/frameworks.md)",
)
