"""TRL's loss normalisation, by ``loss_type``, and the settings that give zero-advantage rows a gradient.

Read from ``GRPOTrainer._compute_loss`` (TRL 1.16; older TRLs have a subset of the types).
The extra division by ``current_gradient_accumulation_steps`` is the same for every
micro-batch of a window, so it does not depend on which rows are present.
"""

from __future__ import annotations

from typing import Any

from grpo_patches.errors import OptionError
from grpo_patches.zero_advantage import GradientTerm

#: ``loss_type`` -> what one micro-batch's loss is divided by (:data:`grpo_patches.zero_advantage.DENOMINATORS`).
DENOMINATORS: dict[str, str] = {
    "grpo": "rows",  # per-row token mean, mean over local rows
    "sapo": "rows",
    "bnpo": "tokens",  # / local masked tokens
    "dr_grpo": "rows",  # / (local rows * max_completion_length)
    "luspo": "rows",  # per-row token sum, mean over local rows
    "dapo": "fixed",  # / (num_items_in_batch / processes * GA / spg)
    "cispo": "fixed",
    "vespo": "fixed",
}


def denominator(loss_type: str) -> str:
    """What TRL divides a micro-batch's loss by for ``loss_type``.

    :raises OptionError: a loss type this adapter does not know.
    """
    if loss_type not in DENOMINATORS:
        raise OptionError(f"unknown trl loss mode {loss_type!r}; valid ones are: {', '.join(DENOMINATORS)}")
    return DENOMINATORS[loss_type]


def gradient_terms(trainer: Any) -> list[GradientTerm]:
    """The trainer's settings that decide whether zero-advantage rows have a gradient."""
    terms = [
        GradientTerm("beta", float(getattr(trainer, "beta", 0.0)), "a KL term"),
        GradientTerm(
            "top_entropy_quantile",
            float(getattr(trainer, "top_entropy_quantile", 1.0)),
            neutral=1.0,
            why="the entropy quantile is taken over every row of the micro-batch, so dropping rows "
            "changes which tokens enter",
        ),
        GradientTerm("entropy_coef", float(getattr(trainer, "entropy_coef", 0.0) or 0.0), "an entropy bonus"),
    ]
    if getattr(trainer, "use_adaptive_entropy", False):
        terms.append(GradientTerm("use_adaptive_entropy", 1.0, "an adaptive entropy bonus (it can switch on during training)"))
    if getattr(trainer, "aux_loss_enabled", False):
        terms.append(GradientTerm("router_aux_loss_coef", float(getattr(trainer, "router_aux_loss_coef", 0.0)), "a router aux loss"))
    return terms
