"""open-instruct's GRPO loss, as the optimizations need to know it (``grpo_utils.compute_grpo_loss``).

Per token (``grpo_fast.py`` step / ``train_batch``): ``pg_loss = loss_fn(ratio, advantages) * rho``
then ``per_token_loss = pg_loss + beta * kl``, summed over the micro-batch's response tokens and
divided by ``loss_denominator``:

* ``loss_fn="dapo"``: ``max(-A * ratio, -A * clamp(ratio, 1 - clip_lower, 1 + clip_higher))``;
* ``loss_fn="cispo"``: ``-A * clamp(ratio.detach(), max=1 + clip_higher) * new_logprobs``;
* ``rho``: the truncated-IS weights of ``compute_rho_correction`` (on by default), a multiplier;
* ``kl``: one of four estimators of ``new - ref`` (``kl_estimator`` 0-3), zeros without a reference;
* ``loss_denominator="token"``: the accumulation group's response tokens over every rank
  (``calculate_token_counts``, computed from the whole batch before training), or a constant:
  the zero-advantage filter's ``"fixed"`` denominator either way.

Both loss functions are exactly 0, with a gradient exactly 0, on a token whose advantage is
exactly 0 (whatever the ratio and rho, as long as they are finite); the only term that gives
such a token a gradient is ``beta * kl`` with a reference model (:func:`filter_terms`).
"""

from __future__ import annotations

from typing import Any

from grpo_patches.zero_advantage import GradientTerm

#: The loss functions whose per-token loss is a product with the advantage (``GRPOLossType``).
LOSS_FNS = ("dapo", "cispo")


def loss_fn(args: Any) -> str:
    return str(getattr(args.loss_fn, "value", args.loss_fn))


def has_reference(learner: Any) -> bool:
    """Whether the learner's loss reads reference log-probs (the DeepSpeed learner whenever
    ``load_ref_policy``; the OLMo-core learner only at ``beta > 0``)."""
    args = learner.args
    if not args.load_ref_policy:
        return False
    return learner.line == "deepspeed" or float(args.beta) > 0


def filter_terms(learner: Any) -> list[GradientTerm]:
    """The settings that give a zero-advantage micro-batch a gradient (the KL term's coefficient)."""
    beta = float(learner.args.beta) if has_reference(learner) else 0.0
    return [GradientTerm("beta", beta, term="the KL term (beta * kl against the reference model)")]


def unsupported_loss(args: Any) -> list[str]:
    """Loss functions the optimizations do not know (a new ``GRPOLossType``)."""
    name = loss_fn(args)
    if name in LOSS_FNS:
        return []
    return [f"loss_fn={name!r} is not one of {', '.join(LOSS_FNS)} (the losses the adapter knows are exactly 0 at "
            "advantage 0)"]
