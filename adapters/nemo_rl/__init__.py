"""NeMo-RL adapter: GRPO in NeMo-RL v0.5.0, v0.6.0, v0.7.0 and main, run from a source checkout.

The version is read from the source (:mod:`.version`; main reports ``0.8.0.dev0``).
:data:`PATCHES` is the adapter's one patch table; each record narrows the supported range to
the tag lines whose code it fits (``V05`` = v0.5.0, ``V06`` = v0.6.0, ``V06_UP`` = v0.6.0 and later,
``V07_UP`` = v0.7.0 and main). Driver records act in the process that runs ``grpo_train``; worker records act in the
Ray workers, which get grpo_patches through the start-up directory (``grpo-patches run``).

Driver:

- ``grpo.setup`` (always): the reference decision, option checks (:mod:`.driver_setup`); with a
  Megatron policy (``zero_advantage_filter``) on v0.5.0: the filter does not
  cover that tag's Megatron worker, a note or an error (:mod:`.filter_megatron`).
- ``Policy.__init__``, ``Policy.get_reference_policy_logprobs`` (V05, V06; ``logprob_skip``):
  no reference model at KL 0 (:mod:`.reference`; NeMo-RL >= 0.7.0 does this itself).
- ``grpo.grpo_train`` (``logprob_skip``) with ``opd._skip_prev_logprobs`` (V07+) or
  ``Policy.get_logprobs`` (V05, V06) and v0.6.0's ``compute_and_apply_seq_logprob_error_masking``:
  the prev-logprob pass skipped when provably on-policy (:mod:`.old_logprobs`); with several
  optimizer steps per batch (``recompute``), deferred to ``Policy.train`` and run only on the rows
  some loss reads (:mod:`.prev_rows`; the workers' loss: :mod:`.skipped_rows`).
- ``grpo.async_grpo_train`` (``logprob_skip``): only reported (never provably on-policy).
- ``Policy.train`` (always): checked on every call, flags the loss, collects the workers'
  counters (:mod:`.train_call`).
- ``Logger.log_metrics`` / ``log_batched_dict_as_jsonl`` / ``log_plot_token_mult_prob_error``
  (``logprob_skip``): no zero placeholder logged as if real (:mod:`.honest_logs`).

The zero-advantage filter's decision and micro-batches are shared by every tag's worker
(:mod:`.filter`); the filter's counters and renamed kept-rows metrics go into NeMo-RL's own
metrics (:mod:`.metrics`).

Workers:

- ``ClippedPGLossFn.__call__`` (one record per tag line, always): prev log-probs of a skipped
  pass, honest metrics under the filter (:mod:`.loss_call`).
- ``process_global_batch`` and ``aggregate_training_statistics`` of the worker module (V06+,
  always): per-call decisions (:mod:`.worker_train`; not ``DTensorPolicyWorkerV2Impl.train``:
  Ray copies the worker's methods into the actor class it ships, so only the module names they
  call are looked up again in the actor — these records pickle by reference).
- ``get_microbatch_iterator`` of the worker module and ``forward_with_post_processing_fn``
  (V06+, ``zero_advantage_filter``): :mod:`.filter_v060`; ``BatchedDataDict`` micro-batch iterators
  (V05): :mod:`.filter_v050`.
- ``process_global_batch`` and ``aggregate_training_statistics`` of the Megatron worker module (V06+: the
  train call, whatever the options) and its ``get_microbatch_iterator`` (V06+, ``zero_advantage_filter``):
  :mod:`.filter_megatron_worker`.
- ``forward_with_post_processing_fn``, ``apply_temperature_scaling``,
  ``LossPostProcessor.__call__`` of ``nemo_rl.models.automodel.train`` (V06+, ``tiled_loss``):
  :mod:`.tiled`.
- ``get_microbatch_iterator`` and ``automodel_forward_backward`` of the worker module (V06+,
  ``verify_every``): verify mode, each verified optimizer step against NeMo-RL's unpatched
  computation (:mod:`.verify`); its driver side (the skipped prev-logprob pass run and sent to
  the workers on a verify step, their verdicts read back) is part of ``Policy.train``'s record
  (:mod:`.verify_driver`). v0.5.0 has no verify mode (``verify_every`` is refused there).
"""

from __future__ import annotations

from grpo_patches.patching import PatchTarget
from grpo_patches.registry import Adapter

from .version import origin, read_version

_H = "grpo_patches.adapters.nemo_rl"
V05, V06, V05_V06, V06_UP, V07_UP = "<0.6.0", ">=0.6.0,<0.7.0", "<0.7.0", ">=0.6.0", ">=0.7.0"
GRPO = "nemo_rl.algorithms.grpo"
POLICY = "nemo_rl.models.policy.lm_policy"
LOGGER = "nemo_rl.utils.logger"
WORKER = "nemo_rl.models.policy.workers.dtensor_policy_worker_v2"
MEGATRON = "nemo_rl.models.policy.workers.megatron_policy_worker"
TRAIN = "nemo_rl.models.automodel.train"
BATCH = "nemo_rl.distributed.batched_data_dict"
LOSS_V05 = "nemo_rl.algorithms.loss_functions"
LOSS = "nemo_rl.algorithms.loss.loss_functions"
SKIP, FILTER, TILED, VERIFY = "logprob_skip", "zero_advantage_filter", "tiled_loss", "verify_every"

#: Every patch record of the NeMo-RL adapter (module, attribute, wrapper, versions, option).
PATCHES = (
    # driver
    PatchTarget(GRPO, "setup", f"{_H}.driver_setup:setup_wrapper"),
    PatchTarget(POLICY, "Policy.__init__", f"{_H}.reference:policy_init_wrapper", versions=V05_V06, option=SKIP),
    PatchTarget(POLICY, "Policy.get_reference_policy_logprobs", f"{_H}.reference:reference_logprobs_wrapper",
                versions=V05_V06, option=SKIP),
    PatchTarget(GRPO, "grpo_train", f"{_H}.old_logprobs:grpo_train_wrapper", option=SKIP, caller_frame=True),
    PatchTarget(GRPO, "async_grpo_train", f"{_H}.old_logprobs:async_train_wrapper", option=SKIP,
                caller_frame=True),
    PatchTarget("nemo_rl.algorithms.opd", "_skip_prev_logprobs", f"{_H}.old_logprobs:skip_predicate_wrapper",
                versions=V07_UP, option=SKIP),
    PatchTarget(POLICY, "Policy.get_logprobs", f"{_H}.old_logprobs:get_logprobs_wrapper", versions=V05_V06,
                option=SKIP),
    PatchTarget(GRPO, "compute_and_apply_seq_logprob_error_masking", f"{_H}.old_logprobs:seq_error_metrics_wrapper",
                versions=V06, option=SKIP),
    PatchTarget(POLICY, "Policy.train", f"{_H}.train_call:train_wrapper"),
    PatchTarget(LOGGER, "Logger.log_metrics", f"{_H}.honest_logs:log_metrics_wrapper", option=SKIP),
    PatchTarget(LOGGER, "Logger.log_batched_dict_as_jsonl", f"{_H}.honest_logs:log_jsonl_wrapper", option=SKIP),
    PatchTarget(LOGGER, "Logger.log_plot_token_mult_prob_error", f"{_H}.honest_logs:log_plot_wrapper", option=SKIP),
    # workers
    PatchTarget(LOSS_V05, "ClippedPGLossFn.__call__", f"{_H}.loss_call:call_v050", versions=V05),
    PatchTarget(LOSS, "ClippedPGLossFn.__call__", f"{_H}.loss_call:call_v060", versions=V06),
    PatchTarget(LOSS, "ClippedPGLossFn.__call__", f"{_H}.loss_call:call_v070", versions=V07_UP),
    # v0.6.0+ worker module names (Ray ships the worker's methods by value; they look these up again)
    PatchTarget(WORKER, "process_global_batch", f"{_H}.worker_train:process_global_batch_wrapper", versions=V06_UP,
                pickle_by_reference=True),
    PatchTarget(WORKER, "aggregate_training_statistics", f"{_H}.worker_train:aggregate_wrapper", versions=V06_UP,
                pickle_by_reference=True),
    PatchTarget(WORKER, "get_microbatch_iterator", f"{_H}.filter_v060:microbatch_iterator_wrapper", versions=V06_UP,
                option=FILTER, pickle_by_reference=True),
    PatchTarget(BATCH, "BatchedDataDict.make_microbatch_iterator", f"{_H}.filter_v050:microbatch_iterator_wrapper",
                versions=V05, option=FILTER),
    PatchTarget(BATCH, "BatchedDataDict.make_microbatch_iterator_with_dynamic_shapes",
                f"{_H}.filter_v050:dynamic_iterator_wrapper", versions=V05, option=FILTER),
    PatchTarget(TRAIN, "forward_with_post_processing_fn", f"{_H}.tiled:forward_wrapper", versions=V06_UP, option=TILED,
                pickle_by_reference=True),
    PatchTarget(TRAIN, "apply_temperature_scaling", f"{_H}.tiled:temperature_wrapper", versions=V06_UP, option=TILED,
                pickle_by_reference=True),
    PatchTarget(TRAIN, "LossPostProcessor.__call__", f"{_H}.tiled:loss_post_processor_wrapper", versions=V06_UP,
                option=TILED),
    # after the tiled record on the same function: wraps it (a metrics-only micro-batch skips the tiled loss)
    PatchTarget(TRAIN, "forward_with_post_processing_fn", f"{_H}.filter_v060:metrics_only_forward_wrapper",
                versions=V06_UP, option=FILTER, pickle_by_reference=True),
    # verify mode (v0.6.0+ DTensor worker): each verified optimizer step against NeMo-RL's unpatched
    # computation; after the filter's record on get_microbatch_iterator, so it wraps it
    PatchTarget(WORKER, "get_microbatch_iterator", f"{_H}.verify:microbatch_iterator_wrapper", versions=V06_UP,
                option=VERIFY, pickle_by_reference=True),
    PatchTarget(WORKER, "automodel_forward_backward", f"{_H}.verify:forward_backward_wrapper", versions=V06_UP,
                option=VERIFY, pickle_by_reference=True),
    # NeMo-RL's Megatron policy worker (v0.6.0+): the filter (its worker module's names, as for the DTensor worker)
    # (the call brackets whatever the options, as for the DTensor worker: the loss finds the train call, e.g.
    # to put the detached current log-probs in the rows whose prev-logprob pass was skipped, :mod:`.prev_rows`)
    PatchTarget(MEGATRON, "process_global_batch", f"{_H}.filter_megatron_worker:process_global_batch_wrapper",
                versions=V06_UP, pickle_by_reference=True),
    PatchTarget(MEGATRON, "get_microbatch_iterator", f"{_H}.filter_megatron_worker:microbatch_iterator_wrapper",
                versions=V06_UP, option=FILTER, pickle_by_reference=True),
    PatchTarget(MEGATRON, "aggregate_training_statistics", f"{_H}.filter_megatron_worker:aggregate_wrapper",
                versions=V06_UP, pickle_by_reference=True),
    # driver: the other tags' Megatron worker is not patched (a note, or an error for True)
    PatchTarget(GRPO, "setup", f"{_H}.filter_megatron:setup_wrapper", versions=V05, option=FILTER),
    PatchTarget(GRPO, "setup", f"{_H}.filter_megatron:verify_setup_wrapper", versions=V06_UP, option=VERIFY),
)

#: options with no effect of their own in NeMo-RL (``recompute`` acts through the ``logprob_skip`` records:
#: the pass of a multi-step batch deferred to the rows some loss reads, :mod:`.prev_rows`)
NOT_APPLICABLE: dict[str, str] = {}

ADAPTER = Adapter(
    name="nemo_rl",
    distribution="nemo-rl",
    supported=">=0.5.0rc0,<0.9",
    versions_text="v0.5.0 – main",
    install_hint="NeMo-RL is not on PyPI: run from a clone of https://github.com/NVIDIA-NeMo/RL at v0.5.0 or later "
                 "(its own install: uv sync; docs/nemo_rl.md)",
    patches=PATCHES,
    not_applicable=NOT_APPLICABLE,
    read_version=read_version,
    version_origin=origin,
)
