"""NeMo-RL adapter: GRPO in NeMo-RL v0.5.0, v0.6.0, v0.7.0 and main, run from a source checkout.

:data:`FRAMEWORK` is the adapter handle every module asks (options, notes, savings, verify
mode); this is the only place the framework's name is written. The version is read from the
source (:mod:`.version`; main reports ``0.8.0.dev0``). :data:`PATCHES` is the one patch table,
grouped per patched attribute, each stack innermost first; each record narrows the supported
range to the tag lines whose code it fits (``V05`` = v0.5.0, ``V06`` = v0.6.0, ``V06_UP`` =
v0.6.0 and later, ``V07_UP`` = v0.7.0 and main). Driver records act in the process that runs
``grpo_train``; worker records in the Ray workers, which get grpo_patches through the start-up
directory (``grpo-patches run``). Who hands what to whom, in run order: :mod:`.state`.

Driver: ``grpo.setup`` (:mod:`.driver_setup`; the filter's note for v0.5.0's Megatron worker,
:mod:`.zero_advantage_megatron`; verify mode's refusal of the Megatron worker, :mod:`.verify_driver`),
``Policy.__init__`` / ``get_reference_policy_logprobs`` (:mod:`.reference`), ``grpo_train``,
``async_grpo_train``, ``opd._skip_prev_logprobs``, ``Policy.get_logprobs``,
``compute_and_apply_seq_logprob_error_masking`` (:mod:`.old_logprobs`, the row-subset pass
:mod:`.old_logprob_rows`), ``Policy.train`` (:mod:`.policy_train`), ``Logger`` (:mod:`.honest_logs`).

Workers: ``ClippedPGLossFn.__call__`` (:mod:`.loss_call`); the worker module's
``process_global_batch`` / ``aggregate_training_statistics`` (the train call, :mod:`.worker_train`);
``get_microbatch_iterator`` (:mod:`.zero_advantage_v060`, :mod:`.zero_advantage_megatron`; v0.5.0:
``BatchedDataDict``'s iterators, :mod:`.zero_advantage_v050`); ``nemo_rl.models.automodel.train``'s
``forward_with_post_processing_fn`` / ``apply_temperature_scaling`` / ``LossPostProcessor.__call__``
(:mod:`.tiled`, :mod:`.dropped_rows`); ``get_microbatch_iterator`` / ``automodel_forward_backward``
(verify mode, :mod:`.verify`). Module-level worker records pickle by reference: Ray ships the
worker's methods by value, and only the module names they call are looked up again in the actor.
"""

from __future__ import annotations

import functools

from grpo_patches.adapter_handle import AdapterHandle

#: The adapter handle (``grpo_patches.enable("nemo_rl")``): every module of the adapter asks it.
FRAMEWORK = AdapterHandle("nemo_rl")
#: The framework's import package (NeMo-RL runs from a source checkout: :mod:`.version` finds it by this name).
PACKAGE = "nemo_rl"

from grpo_patches.patching import PatchTarget  # noqa: E402  (FRAMEWORK first: the modules import it)
from grpo_patches.registry import Adapter  # noqa: E402

from .version import origin, read_version  # noqa: E402

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
    # -- driver ------------------------------------------------------------------------------------
    # grpo.setup: the setup call (reference decision, option checks), then the Megatron refusals, which
    # read only the config; verify mode's record outermost, as everywhere
    PatchTarget(GRPO, "setup", f"{_H}.driver_setup:setup"),
    PatchTarget(GRPO, "setup", f"{_H}.zero_advantage_megatron:setup", versions=V05, option=FILTER),
    PatchTarget(GRPO, "setup", f"{_H}.verify_driver:setup", versions=V06_UP, option=VERIFY),
    PatchTarget(POLICY, "Policy.__init__", f"{_H}.reference:init", versions=V05_V06, option=SKIP),
    PatchTarget(POLICY, "Policy.get_reference_policy_logprobs", f"{_H}.reference:get_reference_policy_logprobs",
                versions=V05_V06, option=SKIP),
    PatchTarget(GRPO, "grpo_train", f"{_H}.old_logprobs:grpo_train", option=SKIP, caller_frame=True),
    PatchTarget(GRPO, "async_grpo_train", f"{_H}.old_logprobs:async_grpo_train", option=SKIP, caller_frame=True),
    PatchTarget("nemo_rl.algorithms.opd", "_skip_prev_logprobs", f"{_H}.old_logprobs:skip_prev_logprobs",
                versions=V07_UP, option=SKIP),
    PatchTarget(POLICY, "Policy.get_logprobs", f"{_H}.old_logprobs:get_logprobs", versions=V05_V06, option=SKIP),
    PatchTarget(GRPO, "compute_and_apply_seq_logprob_error_masking",
                f"{_H}.old_logprobs:compute_and_apply_seq_logprob_error_masking", versions=V06, option=SKIP),
    PatchTarget(POLICY, "Policy.train", f"{_H}.policy_train:train"),
    PatchTarget(LOGGER, "Logger.log_metrics", f"{_H}.honest_logs:log_metrics", option=SKIP),
    PatchTarget(LOGGER, "Logger.log_batched_dict_as_jsonl", f"{_H}.honest_logs:log_batched_dict_as_jsonl",
                option=SKIP),
    PatchTarget(LOGGER, "Logger.log_plot_token_mult_prob_error", f"{_H}.honest_logs:log_plot_token_mult_prob_error",
                option=SKIP),
    # -- workers -----------------------------------------------------------------------------------
    # the loss: one record per tag line (disjoint ranges, never a stack)
    PatchTarget(LOSS_V05, "ClippedPGLossFn.__call__", f"{_H}.loss_call:call_v050", versions=V05),
    PatchTarget(LOSS, "ClippedPGLossFn.__call__", f"{_H}.loss_call:call_v060", versions=V06),
    PatchTarget(LOSS, "ClippedPGLossFn.__call__", f"{_H}.loss_call:call_v070", versions=V07_UP),
    # the DTensor worker's train call, bracketed by the module names its train() calls (Ray ships train() itself
    # by value), whatever the options: the loss finds the call (skipped rows, the filter's plan)
    PatchTarget(WORKER, "process_global_batch", f"{_H}.worker_train:process_global_batch", versions=V06_UP,
                pickle_by_reference=True),
    PatchTarget(WORKER, "aggregate_training_statistics", f"{_H}.worker_train:aggregate_training_statistics",
                versions=V06_UP, pickle_by_reference=True),
    # get_microbatch_iterator: the filter's micro-batches, inside verify mode's record, which calls the filter's
    # again (passing through) for NeMo-RL's own micro-batches on a verify step
    PatchTarget(WORKER, "get_microbatch_iterator", f"{_H}.zero_advantage_v060:get_microbatch_iterator",
                versions=V06_UP, option=FILTER, pickle_by_reference=True),
    PatchTarget(WORKER, "get_microbatch_iterator", f"{_H}.verify:get_microbatch_iterator", versions=V06_UP,
                option=VERIFY, pickle_by_reference=True),
    PatchTarget(WORKER, "automodel_forward_backward", f"{_H}.verify:automodel_forward_backward", versions=V06_UP,
                option=VERIFY, pickle_by_reference=True),
    # v0.5.0: no module name inside the worker's train(); BatchedDataDict is shipped by reference
    PatchTarget(BATCH, "BatchedDataDict.make_microbatch_iterator",
                f"{_H}.zero_advantage_v050:make_microbatch_iterator", versions=V05, option=FILTER),
    PatchTarget(BATCH, "BatchedDataDict.make_microbatch_iterator_with_dynamic_shapes",
                f"{_H}.zero_advantage_v050:make_microbatch_iterator_with_dynamic_shapes", versions=V05, option=FILTER),
    # forward_with_post_processing_fn: the tiled loss, inside the dropped rows' no-grad forward (a metrics-only
    # micro-batch then skips the tiled loss, which runs only with autograd)
    PatchTarget(TRAIN, "forward_with_post_processing_fn", f"{_H}.tiled:forward_with_post_processing_fn",
                versions=V06_UP, option=TILED, pickle_by_reference=True),
    PatchTarget(TRAIN, "forward_with_post_processing_fn", f"{_H}.dropped_rows:forward_with_post_processing_fn",
                versions=V06_UP, option=FILTER, pickle_by_reference=True),
    PatchTarget(TRAIN, "apply_temperature_scaling", f"{_H}.tiled:apply_temperature_scaling", versions=V06_UP,
                option=TILED, pickle_by_reference=True),
    PatchTarget(TRAIN, "LossPostProcessor.__call__", f"{_H}.tiled:call", versions=V06_UP, option=TILED),
    # NeMo-RL's Megatron policy worker (v0.6.0+): its train call bracketed as the DTensor worker's, and the filter
    PatchTarget(MEGATRON, "process_global_batch", f"{_H}.worker_train:process_global_batch_megatron",
                versions=V06_UP, pickle_by_reference=True),
    PatchTarget(MEGATRON, "aggregate_training_statistics", f"{_H}.worker_train:aggregate_training_statistics_megatron",
                versions=V06_UP, pickle_by_reference=True),
    PatchTarget(MEGATRON, "get_microbatch_iterator", f"{_H}.zero_advantage_megatron:get_microbatch_iterator",
                versions=V06_UP, option=FILTER, pickle_by_reference=True),
)

#: options with no effect of their own in NeMo-RL (``recompute`` acts through the ``logprob_skip`` records:
#: the pass of a multi-step batch deferred to the rows some loss reads, :mod:`.old_logprob_rows`)
NOT_APPLICABLE: dict[str, str] = {}

ADAPTER = Adapter(
    name=FRAMEWORK.name,
    distribution="nemo-rl",
    supported=">=0.5.0rc0,<0.9",
    versions_text="v0.5.0 – main",
    install_hint="NeMo-RL is not on PyPI: run from a clone of https://github.com/NVIDIA-NeMo/RL at v0.5.0 or later "
                 "(its own install: uv sync; docs/nemo_rl.md)",
    patches=PATCHES,
    not_applicable=NOT_APPLICABLE,
    read_version=functools.partial(read_version, PACKAGE),
    version_origin=functools.partial(origin, PACKAGE),
)
