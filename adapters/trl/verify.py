"""Verify mode for TRL's GRPOTrainer and GMPOTrainer: each micro-step of a verify step checked
against TRL's unpatched computation (``verify_every``, :mod:`grpo_patches.verify`).

The record on ``GRPOTrainer.compute_loss`` (option ``verify_every``, the last record on that
method: it wraps the tiled loss's) runs, on the micro-steps of the optimizer steps
:func:`grpo_patches.verify.due` picks (``trainer.state.global_step``, 0-based, as the HF
Trainer counts them), :class:`MicroStep`:

1. the patched computation, as without verification, in a :class:`~.state.LossCall` it enters
   (which then tells what the filter and the tiled loss did and which log-probs the loss used);
2. a skipped old-logprob pass (the recompute decision): TRL's pass, run when the rollout was
   generated (:mod:`.verify_rollout`), against the log-probs the loss used instead,
   ``grpo_patches/verify/old_logprob_max_abs_diff`` (:mod:`.verify_rows`);
3. zero-advantage filter / tiled loss, when they ran: the micro-step's gradient both ways
   (``.grad`` untouched), ``grpo_patches/verify/grad_rel_diff`` (relative L2), through
   :func:`grpo_patches.verify_gradients.compare_gradients`. The unpatched computation is TRL's own
   ``compute_loss`` inside ``FRAMEWORK.unpatched()`` (every other record passes through), on the inputs
   unpatched TRL has (its old-logprob pass where the patches skipped or deferred it). In bf16 /
   fp16 (:mod:`grpo_patches.verify_gradients`) over fp32 weights, TRL's loss with autocast off
   (:mod:`.verify_precision`) is the reference and ``grpo_patches/verify/grad_noise_floor`` TRL's
   own bf16 distance from it; an entropy mask (discontinuous in bf16) is judged with both
   computations in fp32; over bf16 weights the unpatched computation is repeated with the rows
   in reverse order (the noise floor) and, with the tiled loss, run once more with only its
   lm-head in fp32 (:mod:`grpo_patches.verify_fp32_head`): the patched gradient is measured
   from that, within the larger of 2 x TRL's own distance from it and 10 x the floor.

Every rank runs the same computations and :func:`grpo_patches.verify.check` agrees on each
figure (one all-reduce), so all ranks reach the same verdict. The micro-step returns the chosen
loss (:func:`grpo_patches.verify.as_loss`: TRL's backward, loss scaling and DDP hooks
accumulate exactly the chosen gradient); the random state, TRL's metrics and attributes and
the adapter's counters are those the chosen computation left (:mod:`.verify_trace`), plus the
figures (:func:`.metrics.record_verify`, the worst of the logging step). A placeholder of the
deferred pass that the patched loss would read (a filter plugin whose decision at generation
and in the loss differ) is left NaN on a verify step instead of raising
:class:`~grpo_patches.errors.PlaceholderError`: the gradient difference is then infinite, and
the patched result is never used.

On a mismatch, ``verify_action="raise"`` stops the run before the step's update
(:class:`grpo_patches.ExactnessError`); ``"disable"`` switches the optimizations off for the
rest of the run, this micro-step uses the unpatched result and the buffered rollout gets TRL's
full pass (:func:`.verify_rows.unpatch_buffer`), so the run goes on as unpatched.

Not verified: TRL's reference pass at ``beta=0`` (TRL skips it itself: :mod:`.reference`), a
pass the recompute decision adds where TRL's rule goes stale (the fix, not a saving), and a
class that overrides ``compute_loss`` (its loss never reaches the wrapper: noted in ``status()``).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Mapping

from grpo_patches import verify, verify_gradients
from grpo_patches.verify_fp32_head import REFERENCE_METRIC, fp32_head
from grpo_patches.call_args import bind

from . import FRAMEWORK, logprob_pass, metrics, state, verify_precision, verify_rows
from .row_subsets import is_multimodal
from .verify_trace import Trace

#: The half-precision noise floor of the gradient comparison, logged next to it.
NOISE_METRIC = verify.NOISE_METRIC


#: A trainer whose TRL never calls its lm-head module (no fp32-head reference: :meth:`MicroStep.head_reference`).
NO_HEAD_REFERENCE = "_grpo_patches_no_fp32_head_reference"
HEAD_NOTE = "verify_reference"


def compute_loss(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``GRPOTrainer.compute_loss(model, inputs, ...)`` (option ``verify_every``)."""
    if instance is None or not instance.model.training:
        return wrapped(*args, **kwargs)
    step = int(instance.state.global_step)
    if not FRAMEWORK.verify_due(step):
        return wrapped(*args, **kwargs)
    # reentrant checkpointing cannot give gradients to torch.autograd.grad: off for this
    # micro-step (the same gradients, more activation memory)
    with logprob_pass.no_checkpointing(instance) if reentrant_checkpointing(instance) else nullcontext():
        return MicroStep(wrapped, instance, args, kwargs, step).run()


def reentrant_checkpointing(trainer: Any) -> bool:
    """Whether the model checkpoints activations with torch's reentrant variant (TRL's
    ``gradient_checkpointing_kwargs``; given without ``use_reentrant``, torch's default is it)."""
    args = trainer.args
    kwargs = getattr(args, "gradient_checkpointing_kwargs", None)
    return bool(getattr(args, "gradient_checkpointing", False)) and kwargs is not None and \
        kwargs.get("use_reentrant", True) is not False


def reversed_rows(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """A text micro-batch with its rows in reverse order (scalars such as
    ``num_items_in_batch`` as they are): the same loss, summed in another order."""
    import torch

    rows = int(inputs["advantages"].size(0))
    order = torch.arange(rows - 1, -1, -1)
    return {name: value.index_select(0, order.to(value.device))
            if isinstance(value, torch.Tensor) and value.dim() and value.size(0) == rows else value
            for name, value in inputs.items()}


class MicroStep:
    """One micro-step of a verify step (module docstring)."""

    def __init__(self, wrapped: Callable[..., Any], trainer: Any, args: tuple, kwargs: dict, step: int) -> None:
        self.wrapped, self.trainer, self.args, self.kwargs, self.step = wrapped, trainer, args, kwargs, step
        self.arguments = bind(wrapped, args, kwargs)
        self.model, self.inputs = self.arguments["model"], self.arguments["inputs"]
        self.match = verify_rows.find(trainer, self.inputs)
        self.upstream = verify_rows.upstream_inputs(self.inputs, self.match)
        self.trace = Trace(trainer)
        self.start = verify.rng_state()
        self.figures: dict[str, float] = {}
        self.masks = verify_precision.EntropyMasks(trainer)
        self.unpatched_end: tuple | None = None

    def patched(self) -> tuple[Any, state.LossCall, tuple]:
        """The micro-step as without verification: (loss, its LossCall, (trace, random state)).
        A placeholder it would read stays NaN (``LossCall.verifying``): the comparison catches it."""
        with state.LOSS.entered(state.LossCall(verifying=True)) as call:
            loss = self.wrapped(*self.args, **self.kwargs)
        return loss, call, (self.trace.take(), verify.rng_state())

    def unpatched(self, inputs: Mapping[str, Any] | None = None, fp32: bool = False) -> tuple[Any, tuple]:
        """TRL's own computation on the inputs unpatched TRL has, from the same random state
        (``fp32``: autocast off, :func:`.verify_precision.full_precision`)."""
        verify.set_rng_state(self.start)
        with FRAMEWORK.unpatched(), verify_precision.full_precision(self.trainer, self.model) if fp32 else nullcontext():
            loss = self.arguments.call(self.wrapped, inputs=inputs or self.upstream)
        return loss, (self.trace.take(), verify.rng_state())

    def reference(self) -> Any:
        """TRL's loss in fp32 (autocast off; :meth:`on_policy_upstream`'s inputs), its trace dropped."""
        return self.unpatched(self.on_policy_upstream(), fp32=True)[0]

    def head_reference(self) -> Any:
        """TRL's loss with only its lm-head in fp32 (bf16 weights leave no fp32 computation:
        :mod:`grpo_patches.verify_fp32_head`; :meth:`on_policy_upstream`'s inputs), its trace
        dropped (TRL 1.16's own chunked head: :mod:`.verify_fp32_head`); ``None`` where neither the
        head module nor that kernel ran (said in ``status()`` once, not run again in this trainer)."""
        if getattr(self.trainer, NO_HEAD_REFERENCE, False):
            return None
        with fp32_head(self.model) as calls:
            loss = self.unpatched(self.on_policy_upstream())[0]
        if calls.count:
            return loss
        setattr(self.trainer, NO_HEAD_REFERENCE, True)
        FRAMEWORK.note(HEAD_NOTE, "bf16 weights with the tiled loss: judged against the reversed-rows floor only (TRL "
                                  "computed its log-probs without its lm-head module or its chunked kernel, so there is "
                                  "no fp32-head reference to run)", owner=self.trainer)
        return None

    def patched_fp32(self) -> Any:
        """The patched computation again, autocast off (its trace dropped), its entropy masks recorded."""
        verify.set_rng_state(self.start)
        with verify_precision.full_precision(self.trainer, self.model), self.masks.recording(), \
                state.LOSS.entered(state.LossCall(verifying=True)):
            loss = self.wrapped(*self.args, **self.kwargs)
        self.trace.take()
        return loss

    def unpatched_fp32(self) -> Any:
        """The reference with the patched computation's entropy masks (:class:`.verify_precision.EntropyMasks`)."""
        with self.masks.replaying():
            return self.reference()

    def on_policy_upstream(self) -> Mapping[str, Any]:
        """TRL's inputs for an fp32 judgement: a rollout whose pass the recompute decision skipped
        (checked on its own, ``old_logprob_max_abs_diff``) reads its current log-probs, as the
        patched loss does, not TRL's pass rounded in half precision."""
        if self.match is None or not self.match.rollout.skipped:
            return self.upstream
        return {**self.upstream, "old_per_token_logps": None}

    def run(self) -> Any:
        loss, call, end = self.patched()
        if self.match is not None and self.match.rollout.skipped:
            rows = call.keep if call.keep is not None else _all_rows(self.inputs)
            verdict = verify_rows.check_skipped(self.trainer, self.step, self.match, self.inputs, call.logps, rows)
            self.figures.update(verdict.metrics)
            if not verdict.ok:  # "disable": recompute is off; this micro-step and the rollout as unpatched
                verify_rows.note_switched_off(self.trainer, verdict, ["recompute"])
                verify_rows.unpatch_buffer(self.trainer)
                loss, end = self.unpatched()
                return self.finish(loss, end)
        names = [name for name, ran in (("zero_advantage_filter", call.keep is not None or call.packed),
                                        ("pack_kept_rows", call.packed), ("tiled_loss", call.tiled is not None)) if ran]
        if not names:
            return self.finish(loss, end)
        return self.compare_gradients(names, loss, end)

    def compare_gradients(self, names: list[str], patched_loss: Any, patched_end: tuple) -> Any:
        ends: dict[str, tuple] = {}

        def unpatched() -> Any:
            loss, ends["unpatched"] = self.unpatched()
            return loss

        def repeat() -> Any:
            return self.unpatched(reversed_rows(self.upstream))[0]

        fp32 = verify_precision.has_fp32_reference(self.trainer, self.model)
        flips = verify_precision.discontinuous(self.trainer) if verify_rows.is_half(self.trainer) else None
        if flips and not fp32:  # nothing to judge it in: said in status(), never an alarm
            verify_precision.note_unjudged(self.trainer, flips)
            return self.finish(patched_loss, patched_end)
        result = verify_gradients.compare_gradients(
            FRAMEWORK.name, names, self.step, [p for p in self.model.parameters() if p.requires_grad],
            patched=lambda: patched_loss, unpatched=unpatched,
            repeat=None if is_multimodal(self.inputs) else repeat,
            reference=self.reference if fp32 else None,
            head_reference=self.head_reference if "tiled_loss" in names else None,
            exact=(self.patched_fp32, self.unpatched_fp32) if flips else None,
            dtype=verify_rows.compute_dtype(self.trainer),
            detail="the micro-step's gradient against TRL's unpatched loss" + (
                "" if bool(patched_loss.detach().isfinite().all()) else
                "; the patched loss is not finite: a NaN placeholder of the deferred old-logprob pass reached it"),
        )
        self.figures.update(result.verdict.metrics)
        if result.noise_floor is not None:
            self.figures[NOISE_METRIC] = result.noise_floor
        if result.reference_floor is not None:
            self.figures[REFERENCE_METRIC] = result.reference_floor
        entropies = self.masks.max_abs_diff()
        if result.patched and entropies is not None:  # the entropies the replayed masks came from
            verdict = verify.check(FRAMEWORK.name, names, self.step, "entropy_max_abs_diff", entropies,
                                   verify.tolerance(FRAMEWORK.name), detail="the entropies of TRL's entropy mask, fp32")
            self.figures.update(verdict.metrics)
            if not verdict.ok:
                verify_rows.note_switched_off(self.trainer, verdict, names)
                verify_rows.unpatch_buffer(self.trainer)
                return self.finish(*self.unpatched())
        if result.patched:
            return self.finish(result.loss, patched_end)
        verify_rows.note_switched_off(self.trainer, result.verdict, names)
        verify_rows.unpatch_buffer(self.trainer)  # the filter's placeholders give way to TRL's pass
        return self.finish(result.loss, ends["unpatched"])

    def finish(self, loss: Any, end: tuple) -> Any:
        """Leave the trainer as the chosen computation left it, plus the figures."""
        snapshot, rng = end
        self.trace.apply(snapshot)
        verify.set_rng_state(rng)
        metrics.record_verify(self.trainer, self.figures)
        return loss


def _all_rows(inputs: Mapping[str, Any]) -> Any:
    import torch

    return torch.arange(int(inputs["advantages"].size(0)))
