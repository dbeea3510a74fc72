"""TRL adapter: ``GRPOTrainer`` in TRL 0.20 - 1.16 (the versions with the modulo recompute rule).

:data:`PATCHES` is the adapter's one patch table. Records on the same method are applied in
table order (a later one wraps an earlier one):

- ``training_step`` (option ``recompute``): counts the real accumulation window
  (:mod:`.accumulation_window`).
- ``_generate_and_score_completions`` (always; each part checks its option): computes old
  log-probs exactly for the rollouts that need them (``recompute``, :mod:`.old_logprobs`),
  defers the pass to the rows the zero-advantage filter keeps (:mod:`.deferred_pass`) and
  reports the reference pass TRL skips with ``beta == 0`` (``logprob_skip``, :mod:`.reference`).
- ``_get_per_token_logps_and_entropies`` (always; inert outside a loss call): answers the
  policy forward of one loss call for a row subset and/or through the tiled loss
  (:mod:`.policy_forward`). It returns 2 values in TRL 0.20-1.6 and 3 (plus the MoE aux loss)
  from 1.7.
- ``_compute_loss`` (``zero_advantage_filter``): :mod:`.filter`; GMPOTrainer's own
  ``_compute_loss`` (``trl.experimental.gmpo``, TRL 1.7+) gets the same wrapper through its own
  record, applied when that module is imported.
- ``compute_loss`` (``tiled_loss``; TRL 1.16, whose loss normalisers it reproduces): :mod:`.tiled`.
- ``compute_loss`` (``verify_every``; after the tiled loss's record, so it wraps it): on a verify
  step, each micro-step also runs TRL's unpatched computation and compares (:mod:`.verify`;
  the old-logprob pass a verify step needs is kept by :mod:`.verify_rollout`).
- ``__init__`` (always): decides per new trainer which optimizations run for it
  (:mod:`.on_init`), so an incompatible setting or subclass is an error when the trainer is
  built (option ``True``), or that optimization is off for it with a note (``"auto"``). TRL
  warns from ``__init__`` with ``stacklevel=2``: the record keeps the caller's frame.

A subclass that overrides a method an optimization wraps or rests on turns that optimization
off for its class (:mod:`.overrides`), unless the adapter knows the subclass's objective
(GMPO's, for the filter: :mod:`.loss_types`). ``status()["trl"]["by_class"]`` says, per
trainer class, what actually ran.

Counters go to ``grpo_patches.status()`` and TRL's own metrics (:mod:`.metrics`). Wrappers are
named by string so that importing this table imports neither torch nor TRL.
"""

from __future__ import annotations

from grpo_patches.patching import PatchTarget
from grpo_patches.registry import Adapter

GRPO_MODULE = "trl.trainer.grpo_trainer"
GMPO_MODULE = "trl.experimental.gmpo.gmpo_trainer"
_HERE = "grpo_patches.adapters.trl"

#: Every patch record of the TRL adapter (module, attribute, wrapper, versions, option).
PATCHES = (
    PatchTarget(GRPO_MODULE, "GRPOTrainer.training_step", f"{_HERE}.accumulation_window:track_window",
                option="recompute"),
    PatchTarget(GRPO_MODULE, "GRPOTrainer._generate_and_score_completions", f"{_HERE}.old_logprobs:generation_wrapper"),
    PatchTarget(GRPO_MODULE, "GRPOTrainer._get_per_token_logps_and_entropies", f"{_HERE}.policy_forward:route_two",
                versions="<1.7.0.dev0"),
    PatchTarget(GRPO_MODULE, "GRPOTrainer._get_per_token_logps_and_entropies", f"{_HERE}.policy_forward:route_three",
                versions=">=1.7.0.dev0"),
    PatchTarget(GRPO_MODULE, "GRPOTrainer._compute_loss", f"{_HERE}.filter:compute_loss_wrapper",
                option="zero_advantage_filter"),
    PatchTarget(GMPO_MODULE, "GMPOTrainer._compute_loss", f"{_HERE}.filter:compute_loss_wrapper", versions=">=1.7",
                option="zero_advantage_filter"),
    PatchTarget(GRPO_MODULE, "GRPOTrainer.compute_loss", f"{_HERE}.tiled:compute_loss_wrapper", versions=">=1.16",
                option="tiled_loss"),
    PatchTarget(GRPO_MODULE, "GRPOTrainer.compute_loss", f"{_HERE}.verify:compute_loss_wrapper",
                option="verify_every"),
    PatchTarget(GRPO_MODULE, "GRPOTrainer.__init__", f"{_HERE}.on_init:check_on_init", caller_frame=True),
)

ADAPTER = Adapter(name="trl", distribution="trl", versions_text="0.20 – 1.16", supported=">=0.20,<1.17", patches=PATCHES)
