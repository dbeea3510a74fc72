"""grpo_patches: exact optimizations for GRPO training in TRL, verl and NeMo-RL.

``grpo_patches.enable("trl")`` patches the framework; ``status()`` reports what is patched
and what was saved. Importing this package imports neither torch nor any framework.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from grpo_patches.api import disable, enable, status
from grpo_patches.errors import ExactnessError
from grpo_patches.hookspecs import hookimpl, hookspec
from grpo_patches.options import Options
from grpo_patches.plugins import plugin_manager

__version__ = "0.1.0"

__all__ = [
    "ExactnessError",
    "Options",
    "disable",
    "enable",
    "hookimpl",
    "hookspec",
    "plugin_manager",
    "status",
    "tiled_grpo_loss",
]

if TYPE_CHECKING:  # pragma: no cover
    from grpo_patches.tiled_loss import tiled_grpo_loss


def __getattr__(name: str) -> Any:
    # torch is imported only when the tiled loss is first used
    if name == "tiled_grpo_loss":
        from grpo_patches.tiled_loss import tiled_grpo_loss

        return tiled_grpo_loss
    raise AttributeError(f"module 'grpo_patches' has no attribute {name!r}")
