"""open-instruct adapter: GRPO in allenai's open-instruct (v0.3.0 and main), run from a checkout or an install.

open-instruct trains with two learners that share ``open_instruct/grpo_utils.py``:

- the DeepSpeed learner, ``grpo_fast.PolicyTrainerRayProcess.step()``: one Ray actor per GPU;
- the OLMo-core learner, ``olmo_core_train_modules.GRPOTrainModule.train_batch`` (``grpo.py``).

Ray ships the DeepSpeed learner's class to its actors **by value** (``@ray.remote`` leaves an
``ActorClass`` at the module attribute, so cloudpickle cannot find the class by name), and
``python open_instruct/grpo_fast.py`` defines it in ``__main__``: a record on one of its methods
would never reach an actor. Every record here therefore stands on a name the learner looks up at
call time in a module its actor imports itself: ``grpo_utils.<function>`` (called through the
module), the ``RayProcess`` base class and ``CollatedBatchData`` (pickled by reference), the
OLMo-core train module (built inside the actor) and DeepSpeed's engine. ``GRPO_PATCHES=open_instruct``
in the driver's environment reaches every learner: ``grpo_fast.main`` hands its environment to
Ray's workers (``ray.init(runtime_env={"env_vars": ...})``).

Records, per patched attribute (a later record on one attribute wraps the earlier ones):

- ``GRPOExperimentConfig.__post_init__`` (``logprob_skip``): at ``beta == 0`` the config says
  ``load_ref_policy=False`` from the start: no reference engine, pass or checkpoint (:mod:`.reference`).
- ``RayProcess.__init__``, ``GRPOTrainModule.train_batch`` (always): the learners, found again by
  their models (:mod:`.learners`); ``CollatedBatchData.to`` (always): the batch a step trains on,
  its micro-batches, accumulation groups and the zero-advantage plan (:mod:`.steps`).
- ``grpo_utils.compute_logprobs`` (always): the old-logprob pre-pass over the micro-batches a loss
  reads after an optimizer step only (``recompute``) and never over dropped ones
  (``zero_advantage_filter``): :mod:`.old_logprobs`; ``grpo_utils.resolve_old_logprob`` (always):
  the NaN placeholders of the skipped micro-batches, never read by a loss (:mod:`.placeholders`).
- ``grpo_utils.forward_for_logprobs``: the tiled lm-head log-probs (``tiled_loss``,
  :mod:`.tiled`), wrapped by the filter's dropped micro-batches (``zero_advantage_filter``,
  :mod:`.zero_advantage`), wrapped by verify mode (``verify_every``, :mod:`.verify`).
- ``DeepSpeedEngine.set_gradient_accumulation_boundary`` / ``backward``
  (``zero_advantage_filter``): no backward for a dropped micro-batch, the group's boundary moved
  to its last backward (:mod:`.zero_advantage_deepspeed`).
- ``grpo_utils.compute_vllm_local_debug_metrics``, ``accumulate_rho_histograms``,
  ``finalize_rho_histograms``, ``GRPOTrainModule.record_metric`` (``zero_advantage_filter``) and
  ``compute_metrics_from_loss_stats`` (always): honest metrics and the savings (:mod:`.metrics`).
"""

from __future__ import annotations

import functools

from grpo_patches.adapter_handle import AdapterHandle

#: The adapter handle every module of this adapter asks (the only place the name is written).
FRAMEWORK = AdapterHandle("open_instruct")

from grpo_patches.patching import PatchTarget  # noqa: E402  (FRAMEWORK first: the modules import it)
from grpo_patches.registry import Adapter  # noqa: E402

from . import version  # noqa: E402

_H = "grpo_patches.adapters.open_instruct"
UTILS = "open_instruct.grpo_utils"
RAY = "open_instruct.utils"
DATA = "open_instruct.data_types"
OLMO = "open_instruct.olmo_core_train_modules"
ENGINE = "deepspeed.runtime.engine"
SKIP, RECOMPUTE, FILTER, TILED, VERIFY = "logprob_skip", "recompute", "zero_advantage_filter", "tiled_loss", "verify_every"

#: Every patch record of the open-instruct adapter (module, attribute, wrapper, option), grouped per
#: attribute, innermost first. v0.3.0 and main share every patched line (``grpo_utils.py``,
#: ``data_types.py``, ``GRPOTrainModule.train_batch`` are byte-identical), so no record narrows the range.
PATCHES = (
    PatchTarget(UTILS, "GRPOExperimentConfig.__post_init__", f"{_H}.reference:post_init", option=SKIP),
    # the learners and their steps
    PatchTarget(RAY, "RayProcess.__init__", f"{_H}.learners:ray_process_init"),
    PatchTarget(OLMO, "GRPOTrainModule.train_batch", f"{_H}.learners:train_batch"),
    PatchTarget(DATA, "CollatedBatchData.to", f"{_H}.steps:to"),
    # the old-logprob pre-pass and its placeholders (recompute, and the filter's dropped micro-batches)
    PatchTarget(UTILS, "compute_logprobs", f"{_H}.old_logprobs:compute_logprobs"),
    PatchTarget(UTILS, "resolve_old_logprob", f"{_H}.placeholders:resolve_old_logprob"),
    # forward_for_logprobs: the tiled log-probs innermost; the filter decides first whether the
    # micro-batch runs at all; verify mode outermost, around both
    PatchTarget(UTILS, "forward_for_logprobs", f"{_H}.tiled:forward_for_logprobs", option=TILED),
    PatchTarget(UTILS, "forward_for_logprobs", f"{_H}.dropped_rows:forward_for_logprobs", option=FILTER),
    # DeepSpeed: no backward for a dropped micro-batch; the accumulation boundary on the group's last backward
    PatchTarget(ENGINE, "DeepSpeedEngine.set_gradient_accumulation_boundary",
                f"{_H}.zero_advantage_deepspeed:set_gradient_accumulation_boundary", option=FILTER),
    PatchTarget(ENGINE, "DeepSpeedEngine.backward", f"{_H}.zero_advantage_deepspeed:backward", option=FILTER),
    # verify mode: the filter's check when the group's optimizer step comes (the other checks are in the
    # optimizations' own wrappers, each run when verify_every is set)
    PatchTarget(ENGINE, "DeepSpeedEngine.step", f"{_H}.verify:step", option=VERIFY),
    PatchTarget(OLMO, "GRPOTrainModule._do_optim_step", f"{_H}.verify:do_optim_step", option=VERIFY),
    # metrics
    PatchTarget(UTILS, "compute_vllm_local_debug_metrics", f"{_H}.metrics:compute_vllm_local_debug_metrics",
                option=FILTER),
    PatchTarget(UTILS, "accumulate_rho_histograms", f"{_H}.metrics:accumulate_rho_histograms", option=FILTER),
    PatchTarget(UTILS, "finalize_rho_histograms", f"{_H}.metrics:finalize_rho_histograms", option=FILTER),
    PatchTarget(OLMO, "GRPOTrainModule.record_metric", f"{_H}.metrics:record_metric", option=FILTER),
    PatchTarget(UTILS, "compute_metrics_from_loss_stats", f"{_H}.metrics:compute_metrics_from_loss_stats"),
)

DISTRIBUTION = "open-instruct"  # the import name is the framework's name
ADAPTER = Adapter(
    name=FRAMEWORK.name,
    distribution=DISTRIBUTION,
    supported=">=0.3.0,<0.4",
    versions_text="v0.3.0 – main",
    install_hint="open-instruct is not on PyPI: run from a clone of https://github.com/allenai/open-instruct at "
                 "v0.3.0 or later (its own install: uv sync; docs/open_instruct.md)",
    patches=PATCHES,
    read_version=functools.partial(version.read_version, FRAMEWORK.name, DISTRIBUTION),
    version_origin=functools.partial(version.origin, FRAMEWORK.name, DISTRIBUTION),
)
