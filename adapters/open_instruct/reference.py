"""No reference model at beta 0 (option ``logprob_skip``).

open-instruct's ``load_ref_policy`` defaults to True (``grpo_utils.py:148``): the DeepSpeed learner
then builds a second DeepSpeed engine with a full copy of the policy (``grpo_fast.py:447``, unsharded
below ZeRO-3), runs it over every micro-batch of every step (``:611``) whatever ``beta`` is, saves it
into every checkpoint (``ref_policy/``) and feeds it only to ``beta * kl`` and the
``objective/kl*_avg`` metrics. At ``beta == 0`` that term is exactly 0.

open-instruct has the switch itself: ``load_ref_policy=False`` (its validator allows it only at beta
0), which skips the engine, the pass, the Polyak updates and the checkpoint. So the config says it
from the start: wrapping ``GRPOExperimentConfig.__post_init__``, a config made at ``beta == 0`` for
which ``grpo_skip_reference_pass`` says skip gets ``load_ref_policy=False`` (in the driver, before
any learner exists; the learners receive the config as it is). The attribute :data:`SKIPPED` (a
plain string, so that a process without grpo_patches still unpickles the config) tells the
learners that grpo_patches made the change, and why: their savings count only that work.

The KL metrics that exist only because of the reference (``objective/kl{0..3}_avg``: open-instruct
logs zeros for them when there is none) are left out (:mod:`.metrics`). The OLMo-core learner
skips its reference at beta 0 itself (``grpo_olmo_core_actor.py:133``): nothing is saved there.

A config made before ``grpo_patches.enable("open_instruct")`` keeps its reference: enable first, or
set ``GRPO_PATCHES=open_instruct`` in the driver's environment (``status()`` says so when a
learner meets a reference at beta 0).
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.plugins import hook

from . import FRAMEWORK
from .state import StepState

#: Set on a config whose reference grpo_patches switched off: why (a ``str``).
SKIPPED = "_grpo_patches_reference_skipped"


def post_init(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``GRPOExperimentConfig.__post_init__``: ``load_ref_policy=False`` where the reference is not needed."""
    result = wrapped(*args, **kwargs)
    if not instance.load_ref_policy:
        return result
    decision = hook().grpo_skip_reference_pass(framework=FRAMEWORK.name, kl_coefficients={"beta": instance.beta},
                                               kl_metrics_requested=False)
    if decision is not None and decision.skip:
        instance.load_ref_policy = False
        vars(instance)[SKIPPED] = decision.reason
        FRAMEWORK.note("reference_pass", f"skipped: {decision.reason}: load_ref_policy=False, so the DeepSpeed learner "
                       "builds no reference engine, runs no reference pass and saves no ref_policy checkpoint; "
                       "objective/kl*_avg are not logged")
    elif decision is not None:
        FRAMEWORK.note("reference_pass", f"runs: {decision.reason}")
    return result


def on_step(learner: Any, step: StepState) -> None:
    """A step of ``learner`` begins: count the reference work it does not do, or say why it does it."""
    args = learner.args
    own = learner.state
    if learner.line != "deepspeed":
        if "reference" not in own.notes_made and float(args.beta) == 0.0:
            own.notes_made.add("reference")
            FRAMEWORK.note("reference_pass", "not run: open-instruct's OLMo-core learner skips its reference model at "
                           "beta 0 itself (nothing saved by grpo_patches); objective/kl*_avg are not logged",
                           owner=learner.owner)
        return
    if SKIPPED in vars(args):
        if "reference" not in own.notes_made:
            own.notes_made.add("reference")
            FRAMEWORK.report_savings(reference_models_not_built=1)
        FRAMEWORK.report_savings(reference_passes_skipped=1, reference_micro_batches_skipped=step.n)
        step.add(reference_micro_batches_skipped=step.n)
    elif learner.reference is not None and float(args.beta) == 0.0 and "reference" not in own.notes_made:
        own.notes_made.add("reference")
        FRAMEWORK.note("reference_pass", "runs at beta 0: this learner's GRPOExperimentConfig was made before "
                       "grpo_patches.enable('open_instruct') (enable it first, or set GRPO_PATCHES=open_instruct in the "
                       "driver's environment)", owner=learner.owner)
