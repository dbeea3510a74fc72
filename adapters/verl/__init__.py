"""verl adapter: the legacy ``dp_actor`` line (0.6.1-0.7.1) and the engine line (0.8.0-0.9.1).

:data:`PATCHES` is the adapter's one patch table; each record narrows the supported range to
the line whose internals it wraps. Records on one attribute stack in table order.

- legacy actor (``verl.workers.actor.dp_actor``, ``verl.protocol``): the zero-advantage
  filter (:mod:`.legacy_filter`).
- engine (``verl.workers.engine.fsdp.transformer_impl``): the zero-advantage filter
  (:mod:`.engine_filter`).
- reference pass at KL coefficient 0 (:mod:`.reference`): every binding of
  ``need_reference_policy`` (no reference model), placeholders for its readers.
- old-logprob pass on on-policy updates, 0.7.x legacy worker (:mod:`.old_logprobs`).

On one attribute the later record wraps the earlier: the filter is innermost, so the
reference placeholder and the old-logprob checks see verl's unfiltered batch.

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
RAY_TRAINER = "verl.trainer.ppo.ray_trainer"
OLD_SKIP = ">=0.7,<0.8"
#: Every module that binds ``need_reference_policy(config)`` by name (0.6 passes a role mapping: not wrapped).
_NEED_REFERENCE = (
    ("verl.trainer.ppo.utils", ">=0.7"),
    ("verl.trainer.main_ppo", ">=0.7"),
    (RAY_TRAINER, ">=0.7"),
    ("verl.trainer.main_ppo_sync", ">=0.8,<0.9"),
    ("verl.trainer.main_ppo_v0", ">=0.9"),
    ("verl.trainer.ppo.v1.trainer_base", ">=0.9"),
)

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
    # reference pass (and model) at KL coefficient 0
    *(PatchTarget(module, "need_reference_policy", f"{_HERE}.reference:need_reference_policy", versions=versions,
                  option="logprob_skip") for module, versions in _NEED_REFERENCE),
    PatchTarget(RAY_TRAINER, "apply_kl_penalty", f"{_HERE}.reference:apply_kl_penalty", versions=">=0.7",
                option="logprob_skip"),
    PatchTarget(DP_ACTOR, "DataParallelPPOActor.update_policy", f"{_HERE}.reference:update_policy",
                versions=LEGACY, option="logprob_skip"),
    PatchTarget(FSDP_ENGINE, "FSDPEngine.forward_backward_batch", f"{_HERE}.reference:forward_backward_batch",
                versions=ENGINE, option="logprob_skip"),
    # old-logprob pass on on-policy updates (0.7's legacy actor ignores it there)
    PatchTarget(RAY_TRAINER, "RayPPOTrainer._compute_old_log_prob", f"{_HERE}.old_logprobs:compute_old_log_prob",
                versions=OLD_SKIP, option="logprob_skip"),
    PatchTarget(DP_ACTOR, "DataParallelPPOActor.update_policy", f"{_HERE}.old_logprobs:update_policy",
                versions=OLD_SKIP, option="logprob_skip"),
    PatchTarget(DP_ACTOR, "DataParallelPPOActor._forward_micro_batch", f"{_HERE}.old_logprobs:forward_micro_batch",
                versions=OLD_SKIP, option="logprob_skip"),
)

ADAPTER = Adapter(name="verl", distribution="verl", supported=">=0.6.1,<0.10", patches=PATCHES)
