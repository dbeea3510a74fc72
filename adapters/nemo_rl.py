"""nemo_rl adapter: declared, no patch records yet (status reports it as not supported)."""

from __future__ import annotations

from grpo_patches.registry import Adapter

ADAPTER = Adapter(
    name="nemo_rl",
    distribution="nemo-rl",
    supported=">=0.7.0",
    patches=(),
    description="adapter not implemented yet (see ../shared/notes/frameworks.md)",
)
