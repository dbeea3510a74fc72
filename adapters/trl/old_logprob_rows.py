"""The old-logprob pass for the rows the zero-advantage filter keeps, and no others.

TRL computes a rollout's old log-probs (when it needs them) inside
``_generate_and_score_completions``, before it scores the rollout, so it cannot know which
rows will have a zero advantage. With the filter on and ``dropped_rows_metrics=False`` the
dropped rows' old log-probs are never read: their ratio is set to exactly 1 in the loss call
(:mod:`.policy_forward`). So the pass is deferred: TRL's call gets a placeholder
(:meth:`Deferred.answer`, asked through the rollout's :class:`~.state.RolloutCall`), and once the
method returns (advantages known) the pass runs on the rows the ``grpo_filter_zero_advantage``
hook keeps for the whole rollout, with TRL's own arguments and the same weights (nothing
trains in between), on the columns some kept row uses (:mod:`.trim`). The placeholder's other
rows stay NaN: :mod:`.placeholders` keeps them out of every loss (replaced where no gradient
can come of them, an error where one would).
On a rollout a verify step consumes, the rollout's observer runs TRL's pass over every row and
compares the kept rows with it first (:mod:`.verify_rollout`).

Under data parallelism every rank keeps the same number of rows (the hook aligns them), so
every rank runs the same number of forward chunks (ZeRO-3 / FSDP gather inside each).
Not deferred when something reads the old log-probs inside the method (vLLM importance
sampling), with ``dropped_rows_metrics=True`` (then TRL's metrics need every row's), for
multimodal rollouts on TRL < 1.15, or when the filter is off for the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from . import FRAMEWORK, logprob_pass, metrics, placeholders, trim, zero_advantage
from .loss_modes import importance_sampling_on, loss_mask
from .row_subsets import is_multimodal, rows_of
from .state import RolloutCall
from .version import multimodal_rows_supported


@dataclass
class Deferred:
    """One rollout's deferred old-logprob pass: TRL's call (its log-prob method beneath the
    adapter's wrapper, the arguments) and the placeholder it got."""

    method: Callable[..., Any] | None = None
    arguments: dict[str, Any] = field(default_factory=dict)
    placeholder: Any = None

    def answer(self, trainer: Any, method: Callable[..., Any], arguments: Mapping[str, Any], arity: int) -> tuple | None:
        """TRL's old-logprob call (asked through :meth:`.state.RolloutCall.answer`): the placeholder
        answer when this is the deferred pass, else ``None`` (run it)."""
        import torch

        if (self.placeholder is not None or torch.is_grad_enabled()
                or arguments.get("model") is not trainer.model
                or (is_multimodal(arguments) and not multimodal_rows_supported())):
            return None
        ids = arguments["input_ids"]
        self.method, self.arguments = method, dict(arguments)
        self.placeholder = placeholders.new(ids.size(0), int(arguments["logits_to_keep"]), ids.device)
        return (self.placeholder, None) if arity == 2 else (self.placeholder, None, None)


def deferral(trainer: Any) -> Deferred | None:
    """The deferral of one training rollout's pass (``None``: not deferred, module docstring)."""
    applies = (FRAMEWORK.on("zero_advantage_filter") and not FRAMEWORK.on("dropped_rows_metrics")
               and not importance_sampling_on(trainer) and zero_advantage.decide(trainer))
    return Deferred() if applies else None


def complete(trainer: Any, rollout: RolloutCall, output: dict) -> None:
    """After TRL's method returned: run the deferred pass on the kept rows, in place."""
    deferred = rollout.deferred
    if deferred is None or deferred.placeholder is None:
        return
    import torch

    from grpo_patches.plugins import hook

    rows = int(deferred.placeholder.size(0))
    plan = hook().grpo_filter_zero_advantage(
        advantages=output["advantages"], mask=loss_mask(output), denominator="fixed", group=None
    )
    keep = torch.arange(rows, device=deferred.placeholder.device) if plan is None else plan.keep
    method = deferred.method
    kept = rows_of(deferred.arguments, keep, method)
    cut = trim.columns(kept)  # no padding work: the columns some kept row uses
    values = trim.widen(logprob_pass.run(trainer, method, trim.trimmed(kept, cut))[0], cut)
    old = deferred.placeholder.to(values.dtype).index_copy(0, keep.to(values.device), values)
    used = old
    if rollout.observer is not None:  # a verify step consumes this rollout: TRL's pass over every row too
        used = rollout.observer.check_deferred(trainer, method, deferred.arguments, output, old, keep)
    output[placeholders.KEY] = used
    if used is old:  # else verification switched the filter off: the rollout has TRL's full pass
        metrics.report(trainer, old_logprob_rows_skipped=rows - int(keep.numel()),
                       padding_tokens_skipped=cut.tokens(int(keep.numel())))
