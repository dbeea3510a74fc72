"""What an adapter declares: its framework, supported range and patch targets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from packaging.version import Version

from grpo_patches.options import Options
from grpo_patches.patching import PatchTarget


@dataclass(frozen=True)
class Adapter:
    """A framework line's adapter, as data. Adapter modules expose one as ``ADAPTER``.

    :ivar name: the name users pass to :func:`grpo_patches.enable` (``"trl"``).
    :ivar distribution: the installed distribution whose version is checked (``"trl"``).
    :ivar supported: PEP 440 range the adapter supports (``">=0.20,<1.17"``).
    :ivar trigger_module: importing this module applies a deferred ``enable``.
    :ivar targets: ``targets(version)`` lists the records for that version (branching where
        the framework's internals differ).
    :ivar optimizations: the :class:`Options` fields this adapter implements; the others are
        reported as not available in status.
    """

    name: str
    distribution: str
    supported: str
    trigger_module: str
    targets: Callable[[Version], Sequence[PatchTarget]]
    optimizations: tuple[str, ...] = field(default=("recompute", "logprob_skip", "zero_advantage_filter", "tiled_loss"))
    description: str = ""

    def selected_targets(self, version: Version, options: Options) -> list[PatchTarget]:
        """The records to apply: those whose gating option is on."""
        return [
            t for t in self.targets(version) if t.option is None or getattr(options, t.option) not in (False, None)
        ]
