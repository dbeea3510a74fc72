"""Zero-advantage filter for TRL's GRPOTrainer (and GMPOTrainer): rows with advantage 0 cost nothing.

Wraps ``GRPOTrainer._compute_loss`` (and ``GMPOTrainer._compute_loss``, its own record). For
each training micro-step it asks the ``grpo_filter_zero_advantage`` hook which rows to keep
and hands that plan to the policy forward through the micro-step's :class:`~.state.LossCall`
(:mod:`.policy_forward`): kept rows run with gradients,
and TRL's own loss code then runs on the whole ``[B, T]`` micro-batch, so every loss type
keeps its normaliser without the adapter knowing it. The dropped rows' per-token losses are
exactly 0 (their advantage is exactly 0 and their ratio finite) and carry no gradient. The
number of micro-steps and optimizer steps never changes; the filter keeps >= 1 row and,
under data parallelism, every rank keeps (and forwards) the same number of rows.

``dropped_rows_metrics`` (one meaning in every adapter):

* ``False`` (default): the dropped rows get no forward at all, in the loss call and in the
  old-logprob pass (:mod:`.old_logprob_rows`). TRL's metrics that need their forward are logged
  over the kept rows under ``<name>/kept_rows``; the others keep their names and exact
  values (:mod:`.metrics`).
* ``True``: the dropped rows get a no-grad forward (no activations kept, no backward:
  :mod:`.dropped_rows`), so every metric TRL logs is its own, exactly.

The kept rows of every micro-batch run on the columns some kept row uses (:mod:`.trim`:
trailing completion padding, and leading prompt padding where positions allow), counted as
``padding_tokens_skipped``.

The filter is exact only when zero-advantage rows have no gradient: ``beta != 0``, an
entropy bonus, an entropy quantile mask, a router aux loss, or a ``_compute_loss`` the adapter
does not know (a subclass's) give them one or may. With ``zero_advantage_filter=True`` such a
trainer is refused when it is built; with ``"auto"`` the filter switches itself off for it and
says why in ``grpo_patches.status()`` (per trainer class).
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import bind
from grpo_patches.errors import OptionError
from grpo_patches.zero_advantage import filter_problems

from . import FRAMEWORK, dropped_micro_batches, metrics, placeholders, state
from .loss_modes import UnknownObjective, loss_mask, objective_of
from .row_subsets import is_multimodal
from .version import multimodal_rows_supported


def decide(trainer: Any) -> bool:
    """Whether the filter runs for ``trainer`` (decided once, when it is built).

    :raises IncompatibleOptionsError: ``zero_advantage_filter=True`` with a config, a loss type
        or a trainer class that gives zero-advantage rows a gradient or that the adapter does
        not know (names the setting and the fix).
    """
    own = state.of(trainer)
    if own.filter_on is not None:
        return own.filter_on
    try:
        objective = objective_of(trainer)
        problems = filter_problems(objective.gradient_terms(trainer))
    except (UnknownObjective, OptionError) as exc:
        problems = [str(exc)]
    if problems:
        own.filter_on = FRAMEWORK.refuse_or_note("zero_advantage_filter", problems, owner=trainer)
        return False
    own.objective = objective
    own.filter_on = True
    return True


def _note_running(trainer: Any) -> None:
    """The per-class status note: what the filter did so far (written only once it ran)."""
    own = state.of(trainer)
    total = metrics.count_total
    rows = int(total(trainer, "rows_dropped") + total(trainer, "rows_kept"))
    text = (f"on ({own.objective.name} objective): {int(total(trainer, 'rows_dropped'))} of {rows} rows "
            f"left out of the backward, {int(total(trainer, 'padding_tokens_skipped'))} padding token positions "
            "of kept rows not computed")
    if not FRAMEWORK.on("dropped_rows_metrics"):
        text += (f", {int(total(trainer, 'forward_rows_skipped'))} of their policy forwards and "
                 f"{int(total(trainer, 'old_logprob_rows_skipped'))} old-logprob rows skipped; "
                 "metrics that need them are logged as <name>/kept_rows")
    FRAMEWORK.note("zero_advantage_filter", text, owner=trainer)


def compute_loss(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``GRPOTrainer._compute_loss(model, inputs)`` (and GMPO's)."""
    if instance is None or not instance.model.training:
        return wrapped(*args, **kwargs)
    arguments = bind(wrapped, args, kwargs)
    inputs = arguments["inputs"]
    if FRAMEWORK.on("pack_kept_rows") and dropped_micro_batches.skipped(instance, inputs):  # its kept rows are elsewhere
        return dropped_micro_batches.skip(instance, inputs)
    if not FRAMEWORK.on("zero_advantage_filter") or not decide(instance):
        # off (verification may switch it off mid-run): every row is read, no placeholder may be
        return arguments.call(wrapped, inputs=placeholders.guard(inputs))
    if is_multimodal(inputs) and not multimodal_rows_supported():
        FRAMEWORK.note("zero_advantage_filter (multimodal)", "multimodal micro-batches keep every row: "
                       "cutting their per-image inputs by row needs TRL >= 1.15", owner=instance)
        return arguments.call(wrapped, inputs=placeholders.guard(inputs))

    from grpo_patches.plugins import hook

    mask = loss_mask(inputs)
    plan = hook().grpo_filter_zero_advantage(
        advantages=inputs["advantages"], mask=mask, denominator=state.of(instance).objective.denominator, group=None
    )
    if plan is None:
        return arguments.call(wrapped, inputs=placeholders.guard(inputs))
    with_metrics = FRAMEWORK.on("dropped_rows_metrics")
    distributed = getattr(instance.accelerator, "num_processes", 1) > 1
    bucket = metrics.bucket(instance)
    before = metrics.snapshot(bucket) if bucket is not None else {}
    with state.LOSS.joined(state.LossCall) as call, metrics.captured_gamma_weights(instance) as gamma:
        # the deferred pass's placeholders: never read (on a verify step a read one is left NaN for
        # the gradient comparison to catch, and the patched result is then not used)
        inputs = placeholders.guard(inputs, read=plan.keep, strict=not call.verifying)
        call.keep, call.dropped_forward = plan.keep, with_metrics
        call.packed = call.packed or dropped_micro_batches.dealt(instance, arguments["inputs"])
        call.always_split = distributed and with_metrics
        call.fill_logps = inputs.get(placeholders.KEY)
        loss = arguments.call(wrapped, inputs=inputs)
    if not call.used:  # a policy forward we did not answer (moved internals): every row ran
        metrics.report(instance, rows_dropped=0, tokens_dropped=0)
        return loss
    if bucket is not None and not with_metrics:
        real = plan.keep[plan.weights != 0]  # kept for their gradient (not DP-alignment padding)

        def kept_value(name: str) -> float | None:
            if name == "entropy" and call.entropies is not None:
                return metrics.entropy_over(instance, call.entropies, mask, real)
            if name == "vespo/phi_seq_mean" and "phi" in gamma:
                return metrics.row_mean_over(instance, gamma["phi"], real)
            return None

        metrics.relabel(instance, bucket, before, kept_value, packed=bool(state.of(instance).pack_on))
    counts = dict(rows_dropped=plan.rows_dropped, tokens_dropped=plan.tokens_dropped,
                  padding_tokens_skipped=call.padding_tokens_skipped)
    if not with_metrics:
        counts["forward_rows_skipped"] = int(mask.shape[0]) - call.forward_rows
    metrics.report(instance, **counts)
    metrics.add_count(instance, "rows_kept", plan.rows_kept, log=False)
    _note_running(instance)
    return loss
