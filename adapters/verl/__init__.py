"""verl adapter: the legacy ``dp_actor`` line (0.6.1-0.7.1) and the engine line (0.8.0-0.9.1).

:data:`FRAMEWORK` is the adapter as every module of it asks grpo_patches (options, notes,
savings, per-object state, verify mode); :data:`PATCHES` is its one patch table, each record
narrowing the supported range to the line whose internals it wraps; :data:`ADAPTER` registers both.

- zero-advantage filter (:mod:`.zero_advantage`: the per-actor decision): the legacy actor
  (:mod:`.zero_advantage_legacy`), the FSDP engine (:mod:`.zero_advantage_engine`), the Megatron
  engine (Megatron's pipeline schedule and per-token loss, :mod:`.zero_advantage_megatron`), the
  legacy Megatron actor (``MegatronPPOActor``, 0.6.1-0.7.x: :mod:`.zero_advantage_megatron_legacy`);
  ``dropped_rows_metrics=True``: :mod:`.dropped_rows_legacy`, :mod:`.dropped_rows_engine`; the
  legacy actor's kept rows without remove-padding run on the columns they use (:mod:`.trim_legacy`;
  the engine line pads each micro-batch to its own rows already).
- reference pass at KL coefficient 0 (:mod:`.reference`, :mod:`.reference_megatron`): every
  binding of ``need_reference_policy`` (no reference model), the loss without its KL term on every line.
- old-logprob pass on on-policy updates (:mod:`.old_logprobs`, :mod:`.old_logprobs_v1`: the
  trainers' pass; :mod:`.old_logprobs_legacy`: the 0.7.x legacy actor ignores it there;
  :mod:`.old_logprobs_engine`, :mod:`.old_logprobs_megatron`: the engine's loss uses the detached
  current log-probs; :mod:`.old_logprobs_megatron_legacy`: so does the 0.7.x legacy Megatron
  worker's). The skipped pass leaves a NaN placeholder the workers key their substitution on
  (:mod:`.placeholders`); the trainer skips only when its workers substitute and stops when an
  update does not confirm it (:mod:`.skip_guarantee`).
- the minimal old-logprob pass (``recompute``, :mod:`.old_logprob_rows`: the legacy ``RayPPOTrainer``
  defers the pass to the update and runs it only on the rows a loss reads after an optimizer step,
  :mod:`.needed_rows`; :mod:`.row_substitution`: the other rows get the current log-probs before the
  first step, or the run stops); the V1 trainer by TransferQueue keys: :mod:`.old_logprob_rows_v1`.
- the placeholder guard (every option): verl's policy loss refuses a placeholder as old log-probs.
- tiled lm-head loss (:mod:`.tiled`, :mod:`.tiled_policy_loss`, :mod:`.tiled_legacy`,
  :mod:`.tiled_engine`): answers verl's fused-kernel lm-head call with the tiled loss; on the Megatron engine
  (:mod:`.tiled_megatron`) and the legacy Megatron actor (0.6.1-0.7.x, :mod:`.tiled_megatron_legacy`) the fused
  forward's ``linear_cross_entropy`` call with tensor parallel 1 (a note otherwise; 0.6.1 with tied embeddings:
  a note, its fused forward hands the kernel no weight).
- verify mode (``verify_every``; :mod:`.verify`, :mod:`.verify_engine`, :mod:`.verify_legacy`): the
  FSDP engine's and the legacy actor's updates checked against verl's own on chosen steps (every
  other record passes through for it: ``FRAMEWORK.unpatched()``); the Megatron actors are not
  covered (:mod:`.verify_megatron`: an error at their first update, not a silent no-op).

Records on one attribute stack: the later wraps the earlier. The table groups them per attribute,
innermost first, with why that order; ``status()["verl"]["stacks"]`` shows each stack as it runs
(outermost first), and :mod:`.state` what each wrapper hands the others during one update.

Wrappers are named by string so that importing this table imports neither torch nor verl.
Every record is applied when its own module is imported, so each Ray worker gets exactly
the records of the modules it imports (``GRPO_PATCHES=verl`` reaches them: README).
The skeleton every adapter shares: ``adapters/README.md``.
"""
from __future__ import annotations

from grpo_patches.adapter_handle import AdapterHandle
from grpo_patches.patching import PatchTarget
from grpo_patches.registry import Adapter

#: The verl adapter as its modules ask grpo_patches (``from . import FRAMEWORK``): before any of them is imported.
FRAMEWORK = AdapterHandle("verl")

_HERE = "grpo_patches.adapters.verl"
LEGACY = ">=0.6.1,<0.8"
ENGINE = ">=0.8.0"
OLD_SKIP = ">=0.7,<0.8"
#: verl versions whose engine worker substitutes the skipped old log-probs (the worker-side records)
ENGINE_OLD_SKIP = ENGINE
DP_ACTOR = "verl.workers.actor.dp_actor"
FSDP_ENGINE = "verl.workers.engine.fsdp.transformer_impl"
ENGINE_WORKERS = "verl.workers.engine_workers"
LOSSES = "verl.workers.utils.losses"
FUSED = "verl.utils.experimental.torch_functional"
MEGATRON_ENGINE = "verl.workers.engine.megatron.transformer_impl"
MEGATRON_ACTOR = "verl.workers.actor.megatron_actor"  # the legacy Megatron worker's actor (0.6.1-0.7.x)
MEGATRON_WORKERS = "verl.workers.megatron_workers"
MCORE_FUSED = "verl.models.mcore.model_forward_fused"  # binds linear_cross_entropy (the fused Megatron forward)
RAY_TRAINER = "verl.trainer.ppo.ray_trainer"
V1_TRAINER = "verl.trainer.ppo.v1.trainer_base"  # 0.9's V1 (TransferQueue) PPOTrainer
#: Every module that binds ``need_reference_policy(config)`` by name (0.6 passes the role mapping
#: that ``TaskRunner.add_ref_policy_worker`` fills: that method is wrapped instead).
_NEED_REFERENCE = (
    ("verl.trainer.ppo.utils", ">=0.7"),
    ("verl.trainer.main_ppo", ">=0.7"),
    (RAY_TRAINER, ">=0.7"),
    ("verl.trainer.main_ppo_sync", ">=0.8,<0.9"),
    ("verl.trainer.main_ppo_v0", ">=0.9"),
    (V1_TRAINER, ">=0.9"),
)


def _stack(module: str, attribute: str, *layers: tuple[str, str | None, str | None]) -> tuple[PatchTarget, ...]:
    """The records of one attribute, innermost first: ``(wrapper "module:function", versions, option)``."""
    return tuple(PatchTarget(module, attribute, f"{_HERE}.{wrapper}", versions=versions, option=option)
                 for wrapper, versions, option in layers)


#: The legacy ``DataParallelPPOActor`` (0.6.1-0.7.x).
_LEGACY_ACTOR = (
    # the update: the filter innermost (the reference skip and the old-logprob checks see verl's unfiltered
    # batch), the tiled loss outside it (verl's on-policy rule counts the unfiltered mini-batches), verify outermost
    *_stack(DP_ACTOR, "DataParallelPPOActor.update_policy",
            ("zero_advantage_legacy:update_policy", LEGACY, "zero_advantage_filter"),
            ("reference:update_policy", LEGACY, "logprob_skip"),
            ("row_substitution:update_policy", OLD_SKIP, "recompute"),
            ("old_logprobs_legacy:update_policy", OLD_SKIP, "logprob_skip"),
            ("tiled_legacy:update_policy", LEGACY, "tiled_loss"),
            ("verify_legacy:update_policy", LEGACY, "verify_every")),
    # a micro-batch's forward: the tiled loss innermost (it describes the micro-batch as the filter and the
    # old-logprob skip leave it: re-weighted, or the kept rows of it, entropies asked for)
    *_stack(DP_ACTOR, "DataParallelPPOActor._forward_micro_batch",
            ("tiled_legacy:forward_micro_batch", LEGACY, "tiled_loss"),
            ("zero_advantage_legacy:forward_micro_batch", LEGACY, "zero_advantage_filter"),
            ("old_logprobs_legacy:forward_micro_batch", OLD_SKIP, "logprob_skip")),
    # the policy loss: the guard innermost (it sees what verl's loss gets), the tiled loss's outside it, the
    # row substitution outermost (placeholder rows replaced before anything reads them)
    *_stack(DP_ACTOR, "get_policy_loss_fn",
            ("placeholders:get_policy_loss_fn", LEGACY, None),
            ("tiled_policy_loss:get_policy_loss_fn", LEGACY, "tiled_loss"),
            ("row_substitution:get_policy_loss_fn", OLD_SKIP, "recompute")),
    # each optimizer step: counted for the row substitution, then verify mode keeps or compares its gradient
    *_stack(DP_ACTOR, "DataParallelPPOActor._optimizer_step",
            ("row_substitution:optimizer_step", OLD_SKIP, "recompute"),
            ("verify_legacy:optimizer_step", LEGACY, "verify_every")),
    *_stack(DP_ACTOR, "prepare_dynamic_batch", ("zero_advantage_legacy:prepare_dynamic_batch", LEGACY,
                                                "zero_advantage_filter")),
    *_stack("verl.protocol", "DataProto.split", ("zero_advantage_legacy:split", LEGACY, "zero_advantage_filter")),
)

#: The engine workers (0.8+): the FSDP engine, the losses every engine calls, the training worker.
_ENGINE = (
    # the update (the whole batch, every mini-batch): the row substitution counts its optimizer steps inside
    # the on-policy check (which also runs the update with entropies asked for)
    *_stack(ENGINE_WORKERS, "TrainingWorker.train_mini_batch",
            ("row_substitution:train_mini_batch", ENGINE_OLD_SKIP, "recompute"),
            ("old_logprobs_engine:train_mini_batch", ENGINE_OLD_SKIP, "logprob_skip")),
    *_stack(ENGINE_WORKERS, "TrainingWorker.train_batch", ("row_substitution:train_batch", ENGINE_OLD_SKIP,
                                                           "recompute")),
    # one mini-batch (one optimizer step): the filter innermost (the reference skip sees verl's unfiltered
    # batch), verify outermost (it runs the patched mini-batch and verl's own)
    *_stack(FSDP_ENGINE, "FSDPEngine.forward_backward_batch",
            ("zero_advantage_engine:forward_backward_batch", ENGINE, "zero_advantage_filter"),
            ("reference:forward_backward_batch", ENGINE, "logprob_skip"),
            ("verify_engine:forward_backward_batch", ENGINE, "verify_every")),
    # one micro-batch's forward and loss: the tiled loss innermost (it describes the kept rows the dropped-rows
    # forward hands it), the on-policy entropies outermost (they see the whole micro-batch's loss call)
    *_stack(FSDP_ENGINE, "FSDPEngineWithLMHead.forward_step",
            ("tiled_engine:forward_step", ENGINE, "tiled_loss"),
            ("dropped_rows_engine:forward_step", ENGINE, "zero_advantage_filter"),
            ("old_logprobs_engine:forward_step", ENGINE_OLD_SKIP, "logprob_skip")),
    # the policy loss (every engine): the guard innermost, the old log-probs substituted outermost (rows, then
    # the whole pass's), so the tiled loss's check and the guard see the values verl's loss really uses
    *_stack(LOSSES, "get_policy_loss_fn",
            ("placeholders:get_policy_loss_fn", ENGINE, None),
            ("tiled_policy_loss:get_policy_loss_fn", ENGINE, "tiled_loss"),
            ("row_substitution:get_policy_loss_fn", ENGINE_OLD_SKIP, "recompute"),
            ("old_logprobs_engine:get_policy_loss_fn", ENGINE_OLD_SKIP, "logprob_skip")),
)

#: The fused-kernel lm-head calls the tiled loss answers (both lines; FSDP and Megatron).
_FUSED_KERNELS = (
    *_stack(FUSED, "FusedLinearForPPO.forward", ("tiled:forward", None, "tiled_loss"),
            ("verify_fp32_head:forward", None, "verify_every")),
    *_stack(MCORE_FUSED, "linear_cross_entropy", ("tiled_megatron:linear_cross_entropy", None, "tiled_loss")),
)

#: verl's Megatron engine (0.8+).
_MEGATRON_ENGINE = (
    # one mini-batch: the filter innermost (the others see verl's unfiltered batch), then the reference skip,
    # the on-policy entropies, the tiled loss's decision (refused before the schedule runs), verify's refusal
    *_stack(MEGATRON_ENGINE, "MegatronEngine.forward_backward_batch",
            ("zero_advantage_megatron:forward_backward_batch", ENGINE, "zero_advantage_filter"),
            ("reference_megatron:forward_backward_batch", ENGINE, "logprob_skip"),
            ("old_logprobs_megatron:forward_backward_batch", ENGINE_OLD_SKIP, "logprob_skip"),
            ("tiled_megatron:forward_backward_batch", ENGINE, "tiled_loss"),
            ("verify_megatron:forward_backward_batch", ENGINE, "verify_every")),
    *_stack(MEGATRON_ENGINE, "MegatronEngineWithLMHead.postprocess_micro_batch_func",
            ("zero_advantage_megatron:postprocess_micro_batch_func", ENGINE, "zero_advantage_filter")),
    *_stack(MEGATRON_ENGINE, "MegatronEngineWithLMHead.forward_step",
            ("tiled_megatron:forward_step", ENGINE, "tiled_loss")),
)

#: The legacy Megatron worker (0.6.1-0.7.x).
_MEGATRON_LEGACY = (
    # the worker's update: the reference skip's config inside the old-logprob substitution's check
    *_stack(MEGATRON_WORKERS, "ActorRolloutRefWorker.update_actor",
            ("reference_megatron:update_actor", LEGACY, "logprob_skip"),
            ("old_logprobs_megatron_legacy:update_actor", OLD_SKIP, "logprob_skip")),
    # the actor's update: the filter's counts innermost, the tiled loss's decision outside it, verify's refusal
    *_stack(MEGATRON_ACTOR, "MegatronPPOActor.update_policy",
            ("zero_advantage_megatron_legacy:update_policy", LEGACY, "zero_advantage_filter"),
            ("tiled_megatron_legacy:update_policy", LEGACY, "tiled_loss"),
            ("verify_megatron:update_policy", LEGACY, "verify_every")),
    *_stack(MEGATRON_ACTOR, "MegatronPPOActor.forward_backward_batch",
            ("zero_advantage_megatron_legacy:forward_backward_batch", LEGACY, "zero_advantage_filter")),
    *_stack(MEGATRON_ACTOR, "make_batch_generator",
            ("zero_advantage_megatron_legacy:make_batch_generator", LEGACY, "zero_advantage_filter")),
    *_stack(MEGATRON_ACTOR, "get_forward_backward_func",
            ("tiled_megatron_legacy:get_forward_backward_func", LEGACY, "tiled_loss")),
    # the policy loss: the guard innermost, the tiled loss's inside the old-logprob substitution (it checks
    # what verl's loss receives)
    *_stack(MEGATRON_ACTOR, "get_policy_loss_fn",
            ("placeholders:get_policy_loss_fn", LEGACY, None),
            ("tiled_policy_loss:get_policy_loss_fn", LEGACY, "tiled_loss"),
            ("old_logprobs_megatron_legacy:get_policy_loss_fn", OLD_SKIP, "logprob_skip")),
)

#: The trainers (the driver, or verl's ``TaskRunner`` actor): v0 ``RayPPOTrainer`` and 0.9's V1 ``PPOTrainer``.
_TRAINERS = (
    *(record for module, versions in _NEED_REFERENCE
      for record in _stack(module, "need_reference_policy", ("reference:need_reference_policy", versions,
                                                              "logprob_skip"))),
    *_stack("verl.trainer.main_ppo", "TaskRunner.add_ref_policy_worker",
            ("reference:add_ref_policy_worker", "<0.7", "logprob_skip")),
    *_stack(RAY_TRAINER, "apply_kl_penalty", ("reference:apply_kl_penalty", None, "logprob_skip")),
    # the old-logprob pass: the minimal pass (recompute) inside the whole-pass skip (logprob_skip), which
    # decides first and, skipping, leaves nothing to defer
    *_stack(RAY_TRAINER, "RayPPOTrainer._compute_old_log_prob",
            ("old_logprob_rows:compute_old_log_prob", ">=0.7", "recompute"),
            ("old_logprobs:compute_old_log_prob", ">=0.7", "logprob_skip")),
    *_stack(V1_TRAINER, "PPOTrainer._compute_old_log_prob",
            ("old_logprob_rows_v1:compute_old_log_prob", ">=0.9", "recompute"),
            ("old_logprobs_v1:compute_old_log_prob", ">=0.9", "logprob_skip")),
    # the actor update: the deferred pass runs outermost (before anything trains), then the check that the
    # workers confirmed what the trainer skipped
    *_stack(RAY_TRAINER, "RayPPOTrainer._update_actor",
            ("old_logprobs:update_actor", ">=0.7", "logprob_skip"),
            ("old_logprob_rows:update_actor", ">=0.7", "recompute")),
    *_stack(V1_TRAINER, "PPOTrainer._update_actor",
            ("old_logprobs_v1:update_actor", ">=0.9", "logprob_skip"),
            ("old_logprob_rows_v1:update_actor", ">=0.9", "recompute")),
)

#: Every patch record of the verl adapter (module, attribute, wrapper, versions, option); while verify
#: mode runs verl's unpatched computation (``FRAMEWORK.unpatched()``) every record but its own passes through.
PATCHES = (*_LEGACY_ACTOR, *_ENGINE, *_FUSED_KERNELS, *_MEGATRON_ENGINE, *_MEGATRON_LEGACY, *_TRAINERS)

#: options with no effect of their own in verl, and what they do here instead (status() notes)
NOT_APPLICABLE: dict[str, str] = {}

ADAPTER = Adapter(name=FRAMEWORK.name, distribution="verl", versions_text="0.6.1 – 0.9.1", supported=">=0.6.1,<0.10",
                  patches=PATCHES, not_applicable=NOT_APPLICABLE)
