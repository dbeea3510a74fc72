"""verl adapter: declared, no patch records yet (status reports it as not supported)."""

from __future__ import annotations

from grpo_patches.registry import Adapter

ADAPTER = Adapter(
    name="verl",
    distribution="verl",
    supported=">=0.6.1",
    patches=(),
    description="adapter not implemented yet (see ../shared/notes/frameworks.md)",
)
