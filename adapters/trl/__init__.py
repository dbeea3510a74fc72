"""TRL adapter: ``GRPOTrainer`` in TRL 0.20 - 1.16 (the versions with the modulo recompute rule).

:data:`FRAMEWORK` is what every module of the adapter asks (options, notes, savings, per-trainer
state, verify mode's schedule); :data:`PATCHES` is the adapter's one patch table, grouped per
attribute, each stack written innermost first (a later record wraps an earlier one);
:data:`ADAPTER` registers both. What runs in which order for one optimizer step, and who hands
what to whom, is in :mod:`.state`.

A subclass that overrides a method an optimization wraps or rests on turns that optimization
off for its class (:mod:`.overrides`), unless the adapter knows the subclass's objective
(GMPO's, for the filter: :mod:`.loss_modes`). ``status()["trl"]["by_class"]`` says, per
trainer class, what actually ran; ``status()["trl"]["stacks"]`` each attribute's wrappers as
they run, outermost first. Wrappers are named by string so that importing this table imports
neither torch nor TRL.
"""

from __future__ import annotations

from grpo_patches.adapter_handle import AdapterHandle
from grpo_patches.patching import PatchTarget
from grpo_patches.registry import Adapter

#: The TRL adapter as its modules see it (the only place the framework's name is written).
FRAMEWORK = AdapterHandle("trl")

GRPO_MODULE = "trl.trainer.grpo_trainer"
GMPO_MODULE = "trl.experimental.gmpo.gmpo_trainer"
_HERE = "grpo_patches.adapters.trl"
#: The first TRL whose log-prob method also returns the MoE aux loss (3 values instead of 2).
_AUX_LOSS = "1.7.0.dev0"

#: Every patch record of the TRL adapter (module, attribute, wrapper, versions, option).
PATCHES = (
    # Each new trainer: which optimizations run for it, decided once (an incompatible setting is an
    # error when the trainer is built). TRL warns from __init__ with stacklevel=2: the caller's frame.
    PatchTarget(GRPO_MODULE, "GRPOTrainer.__init__", f"{_HERE}.on_init:init", caller_frame=True),
    # Each micro-step: counts the HF Trainer's real accumulation window (the recompute decision's and
    # packing's input; a counter, so always applied).
    PatchTarget(GRPO_MODULE, "GRPOTrainer.training_step", f"{_HERE}.accumulation_window:training_step"),
    # Each training micro-step: the window's kept rows dealt into full micro-batches before TRL serves one.
    PatchTarget(GRPO_MODULE, "GRPOTrainer._prepare_inputs", f"{_HERE}.packing:prepare_inputs",
                option="pack_kept_rows"),
    # A rollout, innermost first: the old-logprob pass (recompute decision, deferral to the kept rows,
    # the reference pass observed); verify mode outermost, so that it sees the rollout the others
    # made and, on a rollout a verify step consumes, TRL's own pass over every row.
    PatchTarget(GRPO_MODULE, "GRPOTrainer._generate_and_score_completions",
                f"{_HERE}.old_logprobs:generate_and_score_completions"),
    PatchTarget(GRPO_MODULE, "GRPOTrainer._generate_and_score_completions",
                f"{_HERE}.verify_rollout:generate_and_score_completions", option="verify_every"),
    # TRL's log-prob method: answers the policy forward of a loss call (row subsets, tiled loss) and a
    # rollout's old-logprob call (the deferral's placeholder, verify mode's pass); one record per return shape.
    PatchTarget(GRPO_MODULE, "GRPOTrainer._get_per_token_logps_and_entropies",
                f"{_HERE}.policy_forward:get_per_token_logps_and_entropies", versions=f"<{_AUX_LOSS}"),
    PatchTarget(GRPO_MODULE, "GRPOTrainer._get_per_token_logps_and_entropies",
                f"{_HERE}.policy_forward:get_per_token_logps_and_entropies_v1_7", versions=f">={_AUX_LOSS}"),
    # The loss of one micro-batch: the zero-advantage filter (GMPOTrainer's own _compute_loss gets the
    # same wrapper through its own record, applied when its module is imported).
    PatchTarget(GRPO_MODULE, "GRPOTrainer._compute_loss", f"{_HERE}.zero_advantage:compute_loss",
                option="zero_advantage_filter"),
    PatchTarget(GMPO_MODULE, "GMPOTrainer._compute_loss", f"{_HERE}.zero_advantage:compute_loss", versions=">=1.7",
                option="zero_advantage_filter"),
    # A micro-step's loss, innermost first: the tiled loss (TRL 1.16, whose normalisers it reproduces);
    # verify mode outermost, so that its patched computation is the tiled loss's and its unpatched one TRL's.
    PatchTarget(GRPO_MODULE, "GRPOTrainer.compute_loss", f"{_HERE}.tiled:compute_loss", versions=">=1.16",
                option="tiled_loss"),
    PatchTarget(GRPO_MODULE, "GRPOTrainer.compute_loss", f"{_HERE}.verify:compute_loss", option="verify_every"),
    # TRL's own chunked head: in fp32 within verify mode's fp32-head reference (bf16 weights), else passing through.
    PatchTarget("trl.kernels.chunked_logprob", "ChunkedLogProbFunction.forward",
                f"{_HERE}.verify_fp32_head:chunked_logprob_forward", versions=">=1.16", option="verify_every"),
)

ADAPTER = Adapter(name=FRAMEWORK.name, distribution="trl", versions_text="0.20 – 1.16", supported=">=0.20,<1.17",
                  patches=PATCHES)
