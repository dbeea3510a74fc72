"""verl adapter: the legacy ``dp_actor`` line (0.6.1-0.7.1) and the engine line (0.8.0-0.9.1).

:data:`PATCHES` is the adapter's one patch table; each record narrows the supported range to
the line whose internals it wraps. Records on one attribute stack in table order.

- zero-advantage filter (:mod:`.filter`: the per-actor decision): the legacy actor
  (``verl.workers.actor.dp_actor``, ``verl.protocol``: :mod:`.filter_legacy`), the FSDP engine
  (``verl.workers.engine.fsdp.transformer_impl``: :mod:`.filter_engine`), the Megatron engine
  (``verl.workers.engine.megatron.transformer_impl``: Megatron's pipeline schedule and
  per-token loss, :mod:`.filter_megatron`), the legacy Megatron actor (``MegatronPPOActor``,
  0.6.1-0.7.x: :mod:`.filter_megatron_legacy`); ``dropped_rows_metrics=True``:
  :mod:`.filter_legacy_nograd`, :mod:`.filter_engine_nograd`; the legacy actor's kept rows
  without remove-padding run on the columns they use (:mod:`.trim_legacy`; the engine line
  pads each micro-batch to its own rows already).
- reference pass at KL coefficient 0 (:mod:`.reference`): every binding of
  ``need_reference_policy`` (no reference model), the loss without its KL term on every line.
- old-logprob pass on on-policy updates (:mod:`.old_logprobs`: the trainer's pass;
  :mod:`.old_logprobs_legacy`: the 0.7.x legacy actor ignores it there;
  :mod:`.old_logprobs_engine`: the engine's loss uses the detached current log-probs;
  :mod:`.old_logprobs_megatron_legacy`: so does the 0.7.x legacy Megatron worker's). The
  skipped pass leaves a NaN placeholder the workers key their substitution on
  (:mod:`.placeholder`); the trainer skips only when its workers substitute and stops when an
  update does not confirm it (:mod:`.skip_guarantee`).
- the minimal old-logprob pass (``recompute``, :mod:`.old_logprob_rows`: the legacy ``RayPPOTrainer``
  defers the pass to the update and runs it only on the rows a loss reads after an optimizer step,
  :mod:`.old_logprob_rows_plan`; :mod:`.old_logprob_rows_worker`: the other rows get the current
  log-probs before the first step, or the run stops); the V1 trainer by TransferQueue keys:
  :mod:`.old_logprob_rows_v1`.
- the placeholder guard (every option): verl's policy loss refuses a placeholder as old log-probs.
- tiled lm-head loss (:mod:`.tiled`, :mod:`.tiled_policy_loss`, :mod:`.tiled_legacy`,
  :mod:`.tiled_engine`): answers verl's fused-kernel lm-head call with the tiled loss; on the Megatron engine
  (:mod:`.tiled_megatron`) and the legacy Megatron actor (0.6.1-0.7.x, :mod:`.tiled_megatron_legacy`) the fused
  forward's ``linear_cross_entropy`` call with tensor parallel 1 (a note otherwise; 0.6.1 with tied embeddings:
  a note, its fused forward hands the kernel no weight).
- verify mode (``verify_every``; :mod:`.verify`, :mod:`.verify_engine`, :mod:`.verify_legacy`): the
  FSDP engine's and the legacy actor's updates checked against verl's own on chosen steps (every
  other record passes through for it: :mod:`.bypass`); the Megatron engine is not covered (an
  error at its first update, not a silent no-op).

On one attribute the later record wraps the earlier: the filter is innermost, so the
reference skip and the old-logprob checks see verl's unfiltered batch.

Wrappers are named by string so that importing this table imports neither torch nor verl.
Every record is applied when its own module is imported, so each Ray worker gets exactly
the records of the modules it imports (``GRPO_PATCHES=verl`` reaches them: README).
The skeleton every adapter shares: ``adapters/README.md``.
"""
from __future__ import annotations

from grpo_patches.patching import PatchTarget
from grpo_patches.registry import Adapter

from .bypass import bypassable

_HERE = "grpo_patches.adapters.verl"
LEGACY = ">=0.6.1,<0.8"
ENGINE = ">=0.8.0"
DP_ACTOR = "verl.workers.actor.dp_actor"
FSDP_ENGINE = "verl.workers.engine.fsdp.transformer_impl"
RAY_TRAINER = "verl.trainer.ppo.ray_trainer"
V1_TRAINER = "verl.trainer.ppo.v1.trainer_base"  # 0.9's V1 (TransferQueue) PPOTrainer
FUSED = "verl.utils.experimental.torch_functional"
LOSSES = "verl.workers.utils.losses"
OLD_SKIP = ">=0.7,<0.8"
#: verl versions whose engine worker substitutes the skipped old log-probs (the worker-side records)
ENGINE_OLD_SKIP = ENGINE
ENGINE_WORKERS = "verl.workers.engine_workers"
MEGATRON_ENGINE = "verl.workers.engine.megatron.transformer_impl"
MEGATRON_ACTOR = "verl.workers.actor.megatron_actor"  # the legacy Megatron worker's actor (0.6.1-0.7.x)
MEGATRON_WORKERS = "verl.workers.megatron_workers"
MCORE_FUSED = "verl.models.mcore.model_forward_fused"  # binds linear_cross_entropy (the fused Megatron forward)
#: Every module that binds ``need_reference_policy(config)`` by name (0.6 passes the role mapping
#: that ``TaskRunner.add_ref_policy_worker`` fills: that method is wrapped instead).
_NEED_REFERENCE = (
    ("verl.trainer.ppo.utils", ">=0.7"),
    ("verl.trainer.main_ppo", ">=0.7"),
    (RAY_TRAINER, ">=0.7"),
    ("verl.trainer.main_ppo_sync", ">=0.8,<0.9"),
    ("verl.trainer.main_ppo_v0", ">=0.9"),
    ("verl.trainer.ppo.v1.trainer_base", ">=0.9"),
)

#: The legacy Megatron worker (0.6.1-0.7.x, :mod:`.filter_megatron_legacy`, :mod:`.old_logprobs_megatron_legacy`,
#: :mod:`.tiled_megatron_legacy`): the guard innermost, then the filter, the skips' worker side and the tiled loss.
_MEGATRON_LEGACY = (
    PatchTarget(MEGATRON_ACTOR, "get_policy_loss_fn", f"{_HERE}.placeholder:guard_policy_loss", versions=LEGACY),
    # the tiled loss's policy loss: inside the old-logprob substitution (it checks what verl's loss receives)
    PatchTarget(MEGATRON_ACTOR, "get_policy_loss_fn", f"{_HERE}.tiled_policy_loss:get_policy_loss_fn",
                versions=LEGACY, option="tiled_loss"),
    *(PatchTarget(MEGATRON_ACTOR, attribute, f"{_HERE}.filter_megatron_legacy:{wrapper}", versions=LEGACY,
                  option="zero_advantage_filter")
      for attribute, wrapper in (("MegatronPPOActor.update_policy", "update_policy"), ("make_batch_generator",
                                 "make_batch_generator"), ("MegatronPPOActor.forward_backward_batch",
                                                           "forward_backward_batch"))),
    PatchTarget(MEGATRON_WORKERS, "ActorRolloutRefWorker.update_actor", f"{_HERE}.reference:megatron_update_actor",
                versions=LEGACY, option="logprob_skip"),
    PatchTarget(MEGATRON_WORKERS, "ActorRolloutRefWorker.update_actor",
                f"{_HERE}.old_logprobs_megatron_legacy:update_actor", versions=OLD_SKIP, option="logprob_skip"),
    PatchTarget(MEGATRON_ACTOR, "get_policy_loss_fn", f"{_HERE}.old_logprobs_megatron_legacy:get_policy_loss_fn",
                versions=OLD_SKIP, option="logprob_skip"),
    # tiled loss (TP = 1, fused kernels): each training micro-batch's call around verl's forward_step and loss
    PatchTarget(MEGATRON_ACTOR, "get_forward_backward_func", f"{_HERE}.tiled_megatron_legacy:get_forward_backward_func",
                versions=LEGACY, option="tiled_loss"),
    PatchTarget(MEGATRON_ACTOR, "MegatronPPOActor.update_policy", f"{_HERE}.tiled_megatron_legacy:update_policy",
                versions=LEGACY, option="tiled_loss"),
)

#: Every patch record of the verl adapter (module, attribute, wrapper, versions, option); each
#: wrapper passes through while verify mode runs verl's unpatched computation (:mod:`.bypass`).
PATCHES = bypassable((
    # the placeholder guard, whatever the options: innermost, it sees what verl's policy loss gets
    PatchTarget(DP_ACTOR, "get_policy_loss_fn", f"{_HERE}.placeholder:guard_policy_loss", versions=LEGACY),
    PatchTarget(LOSSES, "get_policy_loss_fn", f"{_HERE}.placeholder:guard_policy_loss", versions=ENGINE),
    # tiled lm-head loss: innermost on _forward_micro_batch (it sees the micro-batch as the other records leave it)
    PatchTarget(DP_ACTOR, "DataParallelPPOActor._forward_micro_batch", f"{_HERE}.tiled_legacy:forward_micro_batch",
                versions=LEGACY, option="tiled_loss"),
    PatchTarget(DP_ACTOR, "get_policy_loss_fn", f"{_HERE}.tiled_policy_loss:get_policy_loss_fn", versions=LEGACY,
                option="tiled_loss"),
    PatchTarget(FUSED, "FusedLinearForPPO.forward", f"{_HERE}.tiled:fused_linear_forward", option="tiled_loss"),
    PatchTarget(FSDP_ENGINE, "FSDPEngineWithLMHead.forward_step", f"{_HERE}.tiled_engine:forward_step",
                versions=ENGINE, option="tiled_loss"),
    PatchTarget(LOSSES, "get_policy_loss_fn", f"{_HERE}.tiled_policy_loss:get_policy_loss_fn", versions=ENGINE,
                option="tiled_loss"),
    # zero-advantage filter
    PatchTarget(DP_ACTOR, "DataParallelPPOActor.update_policy", f"{_HERE}.filter_legacy:update_policy",
                versions=LEGACY, option="zero_advantage_filter"),
    PatchTarget(DP_ACTOR, "DataParallelPPOActor._forward_micro_batch", f"{_HERE}.filter_legacy:forward_micro_batch",
                versions=LEGACY, option="zero_advantage_filter"),
    PatchTarget(DP_ACTOR, "prepare_dynamic_batch", f"{_HERE}.filter_legacy:prepare_dynamic_batch",
                versions=LEGACY, option="zero_advantage_filter"),
    PatchTarget("verl.protocol", "DataProto.split", f"{_HERE}.filter_legacy:split",
                versions=LEGACY, option="zero_advantage_filter"),
    PatchTarget(FSDP_ENGINE, "FSDPEngine.forward_backward_batch", f"{_HERE}.filter_engine:forward_backward_batch",
                versions=ENGINE, option="zero_advantage_filter"),
    PatchTarget(FSDP_ENGINE, "FSDPEngineWithLMHead.forward_step", f"{_HERE}.filter_engine_nograd:forward_step",
                versions=ENGINE, option="zero_advantage_filter"),  # outside the tiled loss's record
    # reference pass (and model) at KL coefficient 0
    *(PatchTarget(module, "need_reference_policy", f"{_HERE}.reference:need_reference_policy", versions=versions,
                  option="logprob_skip") for module, versions in _NEED_REFERENCE),
    PatchTarget("verl.trainer.main_ppo", "TaskRunner.add_ref_policy_worker",
                f"{_HERE}.reference:add_ref_policy_worker", versions="<0.7", option="logprob_skip"),
    PatchTarget(RAY_TRAINER, "apply_kl_penalty", f"{_HERE}.reference:apply_kl_penalty", option="logprob_skip"),
    PatchTarget(DP_ACTOR, "DataParallelPPOActor.update_policy", f"{_HERE}.reference:update_policy",
                versions=LEGACY, option="logprob_skip"),
    PatchTarget(FSDP_ENGINE, "FSDPEngine.forward_backward_batch", f"{_HERE}.reference:forward_backward_batch",
                versions=ENGINE, option="logprob_skip"),
    # the minimal old-logprob pass (recompute): deferred to the update, run on the rows a loss reads
    # after an optimizer step; inside the whole-pass skip (logprob_skip), outside the update's check
    PatchTarget(RAY_TRAINER, "RayPPOTrainer._compute_old_log_prob", f"{_HERE}.old_logprob_rows:compute_old_log_prob",
                versions=">=0.7", option="recompute"),
    # old-logprob pass on on-policy updates (0.7's legacy actor ignores it there)
    PatchTarget(RAY_TRAINER, "RayPPOTrainer._compute_old_log_prob", f"{_HERE}.old_logprobs:compute_old_log_prob",
                versions=">=0.7", option="logprob_skip"),
    PatchTarget(V1_TRAINER, "PPOTrainer._compute_old_log_prob", f"{_HERE}.old_logprob_rows_v1:compute_old_log_prob",
                versions=">=0.9", option="recompute"),
    PatchTarget(V1_TRAINER, "PPOTrainer._compute_old_log_prob",
                f"{_HERE}.old_logprobs:compute_old_log_prob_v1", versions=">=0.9", option="logprob_skip"),
    PatchTarget(RAY_TRAINER, "RayPPOTrainer._update_actor", f"{_HERE}.skip_guarantee:update_actor",
                versions=">=0.7", option="logprob_skip"),
    PatchTarget(V1_TRAINER, "PPOTrainer._update_actor",
                f"{_HERE}.skip_guarantee:update_actor_v1", versions=">=0.9", option="logprob_skip"),
    PatchTarget(RAY_TRAINER, "RayPPOTrainer._update_actor", f"{_HERE}.old_logprob_rows:update_actor",
                versions=">=0.7", option="recompute"),
    PatchTarget(V1_TRAINER, "PPOTrainer._update_actor", f"{_HERE}.old_logprob_rows_v1:update_actor",
                versions=">=0.9", option="recompute"),
    # the minimal pass's worker side: skipped rows get the current log-probs before the first optimizer step
    *(PatchTarget(module, attribute, f"{_HERE}.old_logprob_rows_worker:{wrapper}", versions=versions,
                  option="recompute")
      for module, attribute, wrapper, versions in (
          (DP_ACTOR, "get_policy_loss_fn", "get_policy_loss_fn", OLD_SKIP),
          (DP_ACTOR, "DataParallelPPOActor.update_policy", "update_policy", OLD_SKIP),
          (DP_ACTOR, "DataParallelPPOActor._optimizer_step", "optimizer_step", OLD_SKIP),
          (LOSSES, "get_policy_loss_fn", "get_policy_loss_fn", ENGINE_OLD_SKIP),
          (ENGINE_WORKERS, "TrainingWorker.train_mini_batch", "train_mini_batch", ENGINE_OLD_SKIP),
          (ENGINE_WORKERS, "TrainingWorker.train_batch", "optimizer_step", ENGINE_OLD_SKIP))),
    PatchTarget(ENGINE_WORKERS, "TrainingWorker.train_mini_batch", f"{_HERE}.old_logprobs_engine:train_mini_batch",
                versions=ENGINE_OLD_SKIP, option="logprob_skip"),
    PatchTarget(FSDP_ENGINE, "FSDPEngineWithLMHead.forward_step", f"{_HERE}.old_logprobs_engine:forward_step",
                versions=ENGINE_OLD_SKIP, option="logprob_skip"),
    PatchTarget(LOSSES, "get_policy_loss_fn", f"{_HERE}.old_logprobs_engine:get_policy_loss_fn",
                versions=ENGINE_OLD_SKIP, option="logprob_skip"),
    PatchTarget(DP_ACTOR, "DataParallelPPOActor.update_policy", f"{_HERE}.old_logprobs_legacy:update_policy",
                versions=OLD_SKIP, option="logprob_skip"),
    PatchTarget(DP_ACTOR, "DataParallelPPOActor._forward_micro_batch",
                f"{_HERE}.old_logprobs_legacy:forward_micro_batch",
                versions=OLD_SKIP, option="logprob_skip"),
    # Megatron engine (0.8+): the filter innermost, then the reference skip, the on-policy
    # entropies (old_logprobs_engine's collector has forward_backward_batch's call shape) and the tiled note
    PatchTarget(MEGATRON_ENGINE, "MegatronEngine.forward_backward_batch",
                f"{_HERE}.filter_megatron:forward_backward_batch", versions=ENGINE, option="zero_advantage_filter"),
    PatchTarget(MEGATRON_ENGINE, "MegatronEngineWithLMHead.postprocess_micro_batch_func",
                f"{_HERE}.filter_megatron:postprocess_micro_batch_func", versions=ENGINE,
                option="zero_advantage_filter"),
    PatchTarget(MEGATRON_ENGINE, "MegatronEngine.forward_backward_batch",
                f"{_HERE}.reference:megatron_forward_backward_batch", versions=ENGINE, option="logprob_skip"),
    PatchTarget(MEGATRON_ENGINE, "MegatronEngine.forward_backward_batch",
                f"{_HERE}.old_logprobs_engine:forward_step", versions=ENGINE_OLD_SKIP, option="logprob_skip"),
    PatchTarget(MEGATRON_ENGINE, "MegatronEngine.forward_backward_batch",
                f"{_HERE}.tiled_megatron:forward_backward_batch", versions=ENGINE, option="tiled_loss"),
    # tiled loss on the Megatron engine (TP = 1, fused kernels): the micro-batch's call around the
    # schedule's forward and loss, and the fused forward's kernel call answered tile by tile
    PatchTarget(MEGATRON_ENGINE, "MegatronEngineWithLMHead.forward_step", f"{_HERE}.tiled_megatron:forward_step",
                versions=ENGINE, option="tiled_loss"),
    PatchTarget(MCORE_FUSED, "linear_cross_entropy", f"{_HERE}.tiled_megatron:linear_cross_entropy",
                option="tiled_loss"),  # the legacy actor (0.6.1-0.7.x) and the engine
    # tiled loss: outside the filter on update_policy (verl's on-policy rule counts the unfiltered mini-batches)
    PatchTarget(DP_ACTOR, "DataParallelPPOActor.update_policy", f"{_HERE}.tiled_legacy:update_policy",
                versions=LEGACY, option="tiled_loss"),
    *_MEGATRON_LEGACY,
    # verify mode (engine line): outermost, it runs the patched update and verl's own (:mod:`.verify_engine`)
    PatchTarget(FSDP_ENGINE, "FSDPEngine.forward_backward_batch", f"{_HERE}.verify_engine:forward_backward_batch",
                versions=ENGINE, option="verify_every"),
    PatchTarget(MEGATRON_ENGINE, "MegatronEngine.forward_backward_batch",
                f"{_HERE}.verify_engine:megatron_forward_backward_batch", versions=ENGINE, option="verify_every"),
    PatchTarget(MEGATRON_ACTOR, "MegatronPPOActor.update_policy", f"{_HERE}.verify_engine:megatron_update_policy",
                versions=LEGACY, option="verify_every"),
    # verify mode (legacy actor): outermost on update_policy, it runs verl's update and the patched one
    # (:mod:`.verify_legacy`); _optimizer_step keeps / compares each step's gradient
    PatchTarget(DP_ACTOR, "DataParallelPPOActor.update_policy", f"{_HERE}.verify_legacy:update_policy",
                versions=LEGACY, option="verify_every"),
    PatchTarget(DP_ACTOR, "DataParallelPPOActor._optimizer_step", f"{_HERE}.verify_legacy:optimizer_step",
                versions=LEGACY, option="verify_every"),
))

#: options with no effect of their own in verl, and what they do here instead (status() notes)
NOT_APPLICABLE: dict[str, str] = {}

ADAPTER = Adapter(name="verl", distribution="verl", versions_text="0.6.1 – 0.9.1", supported=">=0.6.1,<0.10", patches=PATCHES,
                  not_applicable=NOT_APPLICABLE)
