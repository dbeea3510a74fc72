"""verl adapter: the legacy ``dp_actor`` line (0.6.1-0.7.1) and the engine line (0.8.0-0.9.1).

:data:`PATCHES` is the adapter's one patch table; each record narrows the supported range to
the line whose internals it wraps. Records on one attribute stack in table order.

- legacy actor (``verl.workers.actor.dp_actor``, ``verl.protocol``): the zero-advantage
  filter (:mod:`.legacy_filter`).
- engine (``verl.workers.engine.fsdp.transformer_impl``): the zero-advantage filter
  (:mod:`.engine_filter`).

Wrappers are named by string so that importing this table imports neither torch nor verl.
Every record is applied when its own module is imported, so each Ray worker gets exactly
the records of the modules it imports (``GRPO_PATCHES=verl`` reaches them: README).
"""

from __future__ import annotations

from grpo_patches.patching import PatchTarget
from grpo_patches.registry import Adapter

_HERE = "grpo_patches.adapters.verl"
LEGACY = ">=0.6.1,<0.8"
ENGINE = ">=0.8.0"
DP_ACTOR = "verl.workers.actor.dp_actor"
FSDP_ENGINE = "verl.workers.engine.fsdp.transformer_impl"

#: Every patch record of the verl adapter (module, attribute, wrapper, versions, option).
PATCHES = (
    PatchTarget(DP_ACTOR, "DataParallelPPOActor.update_policy", f"{_HERE}.legacy_filter:update_policy",
                versions=LEGACY, option="zero_advantage_filter"),
    PatchTarget(DP_ACTOR, "DataParallelPPOActor._forward_micro_batch", f"{_HERE}.legacy_filter:forward_micro_batch",
                versions=LEGACY, option="zero_advantage_filter"),
    PatchTarget(DP_ACTOR, "prepare_dynamic_batch", f"{_HERE}.legacy_filter:prepare_dynamic_batch",
                versions=LEGACY, option="zero_advantage_filter"),
    PatchTarget("verl.protocol", "DataProto.split", f"{_HERE}.legacy_filter:split",
                versions=LEGACY, option="zero_advantage_filter"),
    PatchTarget(FSDP_ENGINE, "FSDPEngine.forward_backward_batch", f"{_HERE}.engine_filter:forward_backward_batch",
                versions=ENGINE, option="zero_advantage_filter"),
)

ADAPTER = Adapter(name="verl", distribution="verl", supported=">=0.6.1,<0.10", patches=PATCHES)
