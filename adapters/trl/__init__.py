"""TRL adapter: ``GRPOTrainer`` in TRL 0.20 - 1.16 (the versions with the modulo recompute rule).

Patch records, applied in this order (a later record wraps an earlier one on the same method):

- :mod:`.recompute` (option ``recompute``): ``GRPOTrainer.training_step`` counts the real
  accumulation window.
- :mod:`.generation` (always; each part checks its option): ``GRPOTrainer.
  _generate_and_score_completions`` computes old log-probs exactly for the rollouts that
  need them (``recompute``) and reports the reference pass TRL skips with ``beta == 0``
  (``logprob_skip``, :mod:`.logprob_passes`).
- :mod:`.loss` (options ``zero_advantage_filter``, ``tiled_loss``): the loss path.

Counters go to ``grpo_patches.status()`` and TRL's own metrics (:mod:`.metrics`).
"""

from __future__ import annotations

from packaging.version import Version

from grpo_patches.adapter import Adapter
from grpo_patches.patching import PatchTarget

SUPPORTED = ">=0.20,<1.17"


def targets(version: Version) -> list[PatchTarget]:
    """Every patch record for TRL ``version`` (modules imported lazily: no torch at import)."""
    from grpo_patches.adapters.trl import generation, loss, recompute

    return [
        *recompute.recompute_targets(version),
        *generation.generation_targets(version),
        *loss.loss_targets(version),
    ]


ADAPTER = Adapter(
    name="trl",
    distribution="trl",
    supported=SUPPORTED,
    trigger_module="trl.trainer.grpo_trainer",
    targets=targets,
)
