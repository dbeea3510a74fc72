"""The losses the TRL adapter knows, per trainer class and ``loss_type``: what a micro-batch's
loss is divided by, the settings that give zero-advantage rows a gradient, the tokens the
loss counts, and each ``loss_type`` in the tiled loss's vocabulary (objective, aggregation).

Read from ``GRPOTrainer._compute_loss`` (TRL 1.16; older TRLs have a subset of the types) and
``GMPOTrainer._compute_loss`` (``trl.experimental.gmpo``, TRL 1.7+). The extra division by
``current_gradient_accumulation_steps`` is the same for every micro-batch of a window, so it
does not depend on which rows are present. A subclass that overrides ``_compute_loss`` with
anything else has an objective the adapter does not know (:func:`objective_of`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

from grpo_patches.errors import OptionError
from grpo_patches.patching import overriding_class
from grpo_patches.zero_advantage import GradientTerm

from . import GMPO_MODULE, GRPO_MODULE

#: TRL 1.16 ``loss_type`` -> the tiled loss's (objective, aggregation), as in ``GRPOTrainer._compute_loss``.
LOSS_TYPES: dict[str, tuple[str, str]] = {
    "grpo": ("clip", "seq-mean-token-mean"),
    "sapo": ("sapo", "seq-mean-token-mean"),
    "bnpo": ("clip", "token-mean"),
    "dr_grpo": ("clip", "seq-mean-token-sum-norm"),
    "dapo": ("clip", "token-mean"),  # TRL's default loss_type
    "cispo": ("cispo", "token-mean"),
    "vespo": ("vespo", "token-mean"),
    "luspo": ("clip", "seq-mean-token-sum"),
}

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


def tiled_loss_preset(loss_type: str = "dapo", epsilon_high: float | None = 0.2) -> dict[str, Any]:
    """The tiled loss's options for TRL's ``loss_type`` (``objective``, ``aggregation`` and, for
    CISPO, ``cispo_max_ratio``); options given explicitly go after them, so they win.

    :raises OptionError: a loss type TRL 1.16 does not have.
    """
    if loss_type not in LOSS_TYPES:
        raise OptionError(f"loss_type={loss_type!r} is not supported; use one of {', '.join(map(repr, LOSS_TYPES))}")
    objective, aggregation = LOSS_TYPES[loss_type]
    preset: dict[str, Any] = {"objective": objective, "aggregation": aggregation}
    if loss_type == "cispo":
        preset["cispo_max_ratio"] = epsilon_high  # TRL caps the CISPO ratio at epsilon_high itself (not 1 + it)
    return preset


def loss_mask(inputs: Any) -> Any:
    """The tokens TRL's loss counts: the completion mask, times the tool mask when present."""
    mask = inputs["completion_mask"]
    tool_mask = inputs.get("tool_mask") if hasattr(inputs, "get") else None
    return mask if tool_mask is None else mask * tool_mask


def importance_sampling_on(trainer: Any) -> bool:
    """TRL's vLLM importance-sampling correction (absent before TRL 0.21): the loss then reads
    old log-probs whatever the schedule."""
    return bool(getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False))


def denominator(loss_type: str) -> str:
    """What TRL divides a micro-batch's loss by for ``loss_type``.

    :raises OptionError: a loss type this adapter does not know.
    """
    if loss_type not in DENOMINATORS:
        raise OptionError(f"unknown trl loss mode {loss_type!r}; valid ones are: {', '.join(DENOMINATORS)}")
    return DENOMINATORS[loss_type]


def _kl_and_entropy_mask(trainer: Any) -> list[GradientTerm]:
    """The terms every GRPOTrainer objective shares: the KL term and the high-entropy token mask."""
    return [
        GradientTerm("beta", float(getattr(trainer, "beta", 0.0)), "a KL term"),
        GradientTerm(
            "top_entropy_quantile",
            float(getattr(trainer, "top_entropy_quantile", 1.0)),
            neutral=1.0,
            why="the entropy quantile is taken over every row of the micro-batch, so dropping rows "
            "changes which tokens enter",
        ),
    ]


def gradient_terms(trainer: Any) -> list[GradientTerm]:
    """The trainer's settings that decide whether zero-advantage rows have a gradient."""
    terms = [
        *_kl_and_entropy_mask(trainer),
        GradientTerm("entropy_coef", float(getattr(trainer, "entropy_coef", 0.0) or 0.0), "an entropy bonus"),
    ]
    if getattr(trainer, "use_adaptive_entropy", False):
        terms.append(GradientTerm("use_adaptive_entropy", 1.0, "an adaptive entropy bonus (it can switch on during training)"))
    if getattr(trainer, "aux_loss_enabled", False):
        terms.append(GradientTerm("router_aux_loss_coef", float(getattr(trainer, "router_aux_loss_coef", 0.0)), "a router aux loss"))
    return terms


def gmpo_gradient_terms(trainer: Any) -> list[GradientTerm]:
    """GMPO's loss: ``-exp(mean clipped log-ratio) * A`` per row (+ a sequence KL): no entropy
    bonus, no router aux loss (it never asks for one)."""
    return _kl_and_entropy_mask(trainer)


@dataclass(frozen=True)
class Objective:
    """A loss the adapter knows: its name, its :data:`DENOMINATORS` kind, the settings that
    give zero-advantage rows a gradient, and the class whose ``_compute_loss`` defines it."""

    name: str
    denominator: str
    gradient_terms: Callable[[Any], list[GradientTerm]]
    owner: str


def class_name(klass: type) -> str:
    return f"{klass.__module__}.{klass.__qualname__}"


def _known_class(module: str, name: str) -> type | None:
    return getattr(sys.modules.get(module), name, None)


class UnknownObjective(Exception):
    """The trainer's loss is not one the adapter knows (the message names the class)."""


def objective_of(trainer: Any) -> Objective:
    """The objective ``trainer``'s ``_compute_loss`` computes.

    :raises UnknownObjective: its class overrides ``_compute_loss`` with a loss the adapter
        does not know, or overrides the policy forward the loss patches answer.
    :raises OptionError: a ``loss_type`` the adapter does not know.
    """
    grpo = _known_class(GRPO_MODULE, "GRPOTrainer")
    klass = type(trainer)
    if grpo is None or not isinstance(trainer, grpo):
        raise UnknownObjective(f"{class_name(klass)} is not a GRPOTrainer")
    forward = overriding_class(klass, grpo, "_get_per_token_logps_and_entropies")
    if forward is not None:
        raise UnknownObjective(
            f"{class_name(forward)} overrides GRPOTrainer._get_per_token_logps_and_entropies, "
            "the policy forward the loss patches answer"
        )
    owner = overriding_class(klass, grpo, "_compute_loss")
    if owner is None:
        loss_type = getattr(trainer, "loss_type", "grpo")
        return Objective(loss_type, denominator(loss_type), gradient_terms, class_name(grpo))
    if owner is _known_class(GMPO_MODULE, "GMPOTrainer"):
        return Objective("gmpo", "rows", gmpo_gradient_terms, class_name(owner))  # per-row mean / GA
    raise UnknownObjective(
        f"{class_name(owner)} overrides GRPOTrainer._compute_loss with a loss grpo_patches does not know"
    )
