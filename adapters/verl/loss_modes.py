"""verl's loss aggregation by ``loss_agg_mode``, per code line, and the settings that give
zero-advantage rows a gradient.

Read from ``verl/trainer/ppo/core_algos.py::agg_loss`` and the actors that call it:

* legacy ``dp_actor`` (0.6.1-0.7.1): ``agg_loss`` gets no global counts, so every
  micro-batch divides by its own tokens or by its own rows that have a token; 0.6.1's
  ``seq-mean-token-sum-norm`` divides by the padded response width only (a constant), 0.7.x
  by the rows as well. verl then scales each micro-batch by ``1/GA`` (static) or
  ``rows/ppo_mini_batch_size`` (dynamic): a number that does not depend on which rows are present.
* engine ``ppo_loss`` (0.8.0-0.9.1): every mode divides by global counts set before the
  micro-batches are made (``batch_num_tokens`` all-reduced over DP, the trainer's
  ``global_batch_size``), so a row's share never depends on the other rows present.
"""

from __future__ import annotations

from typing import Any

from packaging.version import Version

from grpo_patches.errors import OptionError
from grpo_patches.zero_advantage import GradientTerm

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

#: (line, ``loss_agg_mode``) -> what one micro-batch's loss is divided by
#: (:data:`grpo_patches.zero_advantage.DENOMINATORS`). ``"rows"`` counts rows with >= 1 token.
DENOMINATORS: dict[tuple[str, str], str] = {
    ("legacy-0.6", "token-mean"): "tokens",  # masked_mean over the micro-batch
    ("legacy-0.6", "seq-mean-token-sum"): "rows",
    ("legacy-0.6", "seq-mean-token-mean"): "rows",
    ("legacy-0.6", "seq-mean-token-sum-norm"): "fixed",  # / loss_mask.shape[-1]
    ("legacy", "token-mean"): "tokens",  # / loss_mask.sum()
    ("legacy", "seq-mean-token-sum"): "rows",
    ("legacy", "seq-mean-token-mean"): "rows",
    ("legacy", "seq-mean-token-sum-norm"): "rows",  # / rows / loss_mask.shape[-1]
    ("engine", "token-mean"): "fixed",  # / global batch_num_tokens * dp_size
    ("engine", "seq-mean-token-sum"): "fixed",  # / global_batch_size * dp_size
    ("engine", "seq-mean-token-mean"): "fixed",
    ("engine", "seq-mean-token-sum-norm"): "fixed",
}

#: ``policy_loss.loss_mode`` values whose per-token loss is (advantage x something of the row
#: alone) and is multiplied by ``rollout_is_weights`` right before ``agg_loss``: rows can be
#: dropped and packed exactly. Value: the agg mode the loss forces (``None``: the config's).
ROW_LOCAL_LOSS_MODES: dict[str, str | None] = {
    "vanilla": None,
    "dppo_tv": None,
    "dppo_kl": None,
    "gpg": None,
    "cispo": None,
    "gspo": "seq-mean-token-mean",
    "sapo": "seq-mean-token-mean",
}


def line_of(version: Version) -> str:
    """The code line a verl version runs its actor on."""
    if version < Version("0.7.0"):
        return "legacy-0.6"
    return "legacy" if version < Version("0.8.0") else "engine"


def denominator(line: str, loss_agg_mode: str) -> str:
    """What verl divides a micro-batch's loss by.

    :raises OptionError: an agg mode this adapter does not know.
    """
    if (line, loss_agg_mode) not in DENOMINATORS:
        raise OptionError(
            f"unknown verl loss_agg_mode {loss_agg_mode!r}; valid ones are: {', '.join(LOSS_AGG_MODES)}"
        )
    return DENOMINATORS[(line, loss_agg_mode)]


def effective_agg_mode(config: Any) -> str:
    """The agg mode the policy loss really uses (gspo / sapo force seq-mean-token-mean)."""
    forced = ROW_LOCAL_LOSS_MODES.get(loss_mode_of(config))
    return forced or config.loss_agg_mode


def loss_mode_of(config: Any) -> str:
    policy_loss = getattr(config, "policy_loss", None)
    if policy_loss is None:
        return "vanilla"
    getter = getattr(policy_loss, "get", None)
    return getter("loss_mode", "vanilla") if getter else getattr(policy_loss, "loss_mode", "vanilla")


def gradient_terms(config: Any) -> list[GradientTerm]:
    """The actor config's coefficients that give zero-advantage rows a gradient unless 0."""
    use_kl = bool(getattr(config, "use_kl_loss", False))
    return [
        GradientTerm("actor.entropy_coeff", float(getattr(config, "entropy_coeff", 0.0) or 0.0), "an entropy bonus"),
        GradientTerm("actor.kl_loss_coef", float(getattr(config, "kl_loss_coef", 0.0)) if use_kl else 0.0,
                     "a KL loss (use_kl_loss=True)"),
    ]


def unsupported_settings(config: Any) -> list[str]:
    """Settings under which dropping rows is not exact (whatever the coefficients), with the fix."""
    problems = []
    loss_mode = loss_mode_of(config)
    if loss_mode not in ROW_LOCAL_LOSS_MODES:
        problems.append(
            f"actor.policy_loss.loss_mode={loss_mode!r} is not row-local (clip_cov / kl_cov choose tokens over the "
            "whole micro-batch, kl_cov gives zero-advantage rows a KL gradient); the filter supports "
            + ", ".join(ROW_LOCAL_LOSS_MODES)
        )
    if getattr(config, "use_prefix_grouper", False):
        problems.append("actor.use_prefix_grouper=True (it forwards whole uid groups); set it to False")
    if getattr(config, "calculate_sum_pi_squared", False):
        problems.append("actor.calculate_sum_pi_squared=True (an output every row needs); set it to False")
    return problems
