"""Verify mode in NeMo-RL's DTensor policy worker v2 (v0.6.0+): each verified optimizer step
checked against NeMo-RL's unpatched computation (``verify_every``, :mod:`grpo_patches.verify`).

The unit is the optimizer step (one global batch): the zero-advantage filter lays the kept rows
out in micro-batches of its own, so a patched micro-batch has no unpatched twin. The worker
module's ``automodel_forward_backward`` (one call per global batch: every micro-batch's forward
and NeMo-RL's own backward) is wrapped; on the global batches :func:`grpo_patches.verify.due`
picks (the worker's optimizer steps, 0-based, counted since it started) and on every call the
driver flagged (:data:`~.state.VERIFY_PREV`, :mod:`.verify_driver`), :class:`GlobalBatchCheck`:

1. runs the patched computation as usual (the filter's micro-batches, the tiled loss), and
   takes the gradient NeMo-RL's backward left in ``.grad`` (with FSDP2 that is the only place a
   sharded parameter's gradient exists; ``.grad`` is then put back as it was);
2. runs NeMo-RL's unpatched computation from the same random state: its own micro-batches of
   the global batch (``get_microbatch_iterator`` called again, :func:`get_microbatch_iterator`),
   inside ``FRAMEWORK.unpatched()`` (every record but verify mode's own passes through) and, on a
   call whose prev-logprob pass the driver skipped and ran for verification, the loss off its
   on-policy path, reading that pass (a row whose pass was skipped and not run for verification
   would be read as NaN there: :class:`~grpo_patches.errors.PlaceholderError` first,
   :func:`.placeholders.check_unpatched`);
3. compares, in this order, on every rank alike (each check one all-reduce):
   a skipped prev-logprob pass: the log-probs the patched loss used (the detached current ones)
   against the pass, over the loss tokens (:func:`.verify_in_loss.measure_prev`), ``grpo_patches/verify/old_logprob_max_abs_diff``;
   a skipped reference pass (v0.6.0 at KL 0): the loss with its zero placeholder against the
   loss with other values there (:func:`.verify_in_loss.measure_reference`), ``grpo_patches/verify/reference_loss_max_abs_diff``
   (a difference cannot be undone: no reference model was built; ``"disable"`` raises too);
   filter / tiled loss: the step's gradient, relative L2, ``grpo_patches/verify/grad_rel_diff``
   (in bf16 / fp16 held to 10 x the noise floor: NeMo-RL's unpatched computation once more,
   one row per micro-batch, ``grpo_patches/verify/grad_noise_floor``, never taken below a tenth
   of the epsilon, :func:`grpo_patches.verify.tolerance`; with sequence packing, whose forward
   the layout changes, the epsilon stands in; with the tiled loss on, NeMo-RL's computation once
   more with its lm-head in fp32, :mod:`grpo_patches.verify_fp32_head`: the gradient is then
   measured from that reference, within the larger of 2 x NeMo-RL's own distance from it,
   ``grpo_patches/verify/grad_reference_floor``, and the tolerance above)
   (:func:`grpo_patches.verify_gradients.judge_gradients`; not compared when the first check failed: the
   unpatched result is used then anyway, and the difference would be blamed on them);
4. leaves ``.grad`` holding exactly the chosen gradient, the random state and NeMo-RL's
   per-micro-batch results as the chosen computation left them (the unpatched ones fitted to
   the number of micro-batches ``train`` counts, :func:`fit_results`), the filter's counters as the
   chosen one saved, and the figures in :attr:`~.state.TrainCall.figures` (put into the metrics
   ``train`` returns by :func:`report`, the largest over the call).

On a mismatch ``verify_action="raise"`` raises :class:`grpo_patches.ExactnessError` in the
worker, before the optimizer step (the driver re-raises it as such, :mod:`.verify_driver`);
``"disable"`` switches the optimization off in this worker (its ``status()``), the step uses the
unpatched result, and the metrics carry ``grpo_patches/verify/switched_off/<option>`` so the
driver switches it off too (the prev-logprob skip is the driver's: from the next step on the
pass runs).

v0.5.0's worker computes its loss inline (no per-global-batch call to wrap): no verify record.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

from grpo_patches import verify, verify_fp32_head as fp32_head, verify_gradients, verify_log
from grpo_patches.call_args import CallArgs, bind
from grpo_patches.errors import ExactnessError

from . import FRAMEWORK
from .placeholders import check_unpatched
from .state import COUNTERS, PREV_IS_CURRENT, VERIFY_PREV, VERIFY_REFERENCE, TrainCall, current_train, worker_state
from .verify_results import fit_results

SKIP, FILTER, TILED = "logprob_skip", "zero_advantage_filter", "tiled_loss"


def get_microbatch_iterator(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``get_microbatch_iterator(...)`` of the worker module (outermost record): in a train call,
    keep how to call it again, for the unpatched computation of a verify step."""
    train = current_train()
    if train is not None:
        call = bind(wrapped, args, kwargs)
        train.remake = lambda: _remade(wrapped, call)
        packed = call["cfg"].get("sequence_packing", {}).get("enabled", False)
        train.rebatch = None if packed else (lambda: _remade(wrapped, call, **_one_row_each(call)))
    return wrapped(*args, **kwargs)


def _remade(wrapped: Callable[..., Any], call: CallArgs, **changes: Any) -> Any:
    """NeMo-RL's own micro-batches of the global batch (the filter's record, inside, passes through
    in ``FRAMEWORK.unpatched()``), once no skipped row could be read as NaN."""
    check_unpatched(call["data"])
    return call.call(wrapped, **changes)


def _one_row_each(call: CallArgs) -> dict[str, Any]:
    """``get_microbatch_iterator``'s arguments changed for the same global batch, one row per
    micro-batch (static): NeMo-RL's loss normalises by the global batch's valid tokens and
    sequences, so only the rounding changes (the noise floor's repeat)."""
    cfg = dict(call["cfg"])
    cfg["dynamic_batching"] = {**cfg.get("dynamic_batching", {}), "enabled": False}
    return {"cfg": cfg, "mbs": 1}


def automodel_forward_backward(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``automodel_forward_backward(model, data_iterator, post_processing_fn, forward_only, ...)``
    of the worker module: one global batch of a train call."""
    train = current_train()
    if train is None:
        return wrapped(*args, **kwargs)
    call = bind(wrapped, args, kwargs)
    if call.get("forward_only") or getattr(call["post_processing_fn"], "loss_fn", None) is not train.loss_fn:
        return wrapped(*args, **kwargs)
    own = worker_state(train.worker)
    step = own.optimizer_steps
    own.optimizer_steps += 1
    prev = isinstance(getattr(train.loss_fn, VERIFY_PREV, None), dict)
    reference = bool(getattr(train.loss_fn, VERIFY_REFERENCE, False))
    names = [name for name, on in ((FILTER, train.filter_on), (TILED, train.tiled_on)) if on]
    if not (prev or reference or (names and FRAMEWORK.verify_due(step))) or train.remake is None:
        return wrapped(*args, **kwargs)
    return GlobalBatchCheck(wrapped, call, train, step, names, prev, reference).run()


@contextmanager
def unpatched_computation(train: TrainCall) -> Iterator[None]:
    """NeMo-RL's own computation: every record but verify mode's passes through
    (``FRAMEWORK.unpatched()``) and the loss object is as the user configured it (off the
    on-policy path the driver put it on for a skipped pass)."""
    loss_fn = train.loss_fn
    original = getattr(loss_fn, VERIFY_PREV, None)
    saved = {name: loss_fn.__dict__.get(name, _ABSENT) for name in ("force_on_policy_ratio", PREV_IS_CURRENT)}
    if isinstance(original, dict):
        _set(loss_fn, "force_on_policy_ratio", original.get("force_on_policy_ratio", _ABSENT))
        _set(loss_fn, PREV_IS_CURRENT, _ABSENT)
    try:
        with FRAMEWORK.unpatched():
            yield
    finally:
        for name, value in saved.items():
            _set(loss_fn, name, value)


_ABSENT = object()


def _set(obj: Any, name: str, value: Any) -> None:
    if value is _ABSENT or value is None and name == "force_on_policy_ratio":
        obj.__dict__.pop(name, None)
    else:
        setattr(obj, name, value)


def _take_grads(params: list) -> list:
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    return grads


class GlobalBatchCheck:
    """One verified global batch (module docstring)."""

    def __init__(self, wrapped: Callable[..., Any], call: CallArgs, train: TrainCall, step: int,
                 names: list[str], prev: bool, reference: bool = False) -> None:
        self.wrapped, self.call, self.train, self.step, self.names, self.prev = wrapped, call, train, step, names, prev
        self.reference = reference
        self.params = [p for p in call["model"].parameters() if p.requires_grad]
        mesh = getattr(train.worker, "dp_mesh", None)
        self.group = mesh.get_group() if mesh is not None else None
        self.dtype = getattr(train.worker, "dtype", None)

    def patched(self) -> tuple[Any, list, Any]:
        self.train.prev_diff = 0.0 if self.prev else None
        self.train.reference_diff = 0.0 if self.reference else None
        try:
            results = self.call.call(self.wrapped)
        finally:
            self.prev_measured, self.train.prev_diff = self.train.prev_diff, None
            self.reference_measured, self.train.reference_diff = self.train.reference_diff, None
        return results, _take_grads(self.params), verify.rng_state()

    def unpatched(self, start: Any, remake: Callable[[], Any] | None = None) -> tuple[Any, list, Any]:
        verify.set_rng_state(start)
        with unpatched_computation(self.train):
            iterator, length = (remake or self.train.remake)()
            changes = {"data_iterator": iterator}
            if "num_valid_microbatches" in self.call:
                changes["num_valid_microbatches"] = length
            if remake is None:
                self.plain_valid = length
            results = self.call.call(self.wrapped, **changes)
        return results, _take_grads(self.params), verify.rng_state()

    def run(self) -> Any:
        before = _take_grads(self.params)
        start = verify.rng_state()
        patched = self.patched()
        plain = self.unpatched(start)
        floor, reference = None, None
        if self.names and self.train.rebatch is not None and verify.needs_noise_floor(FRAMEWORK.name, self.dtype):
            floor = verify.noise_floor(self.unpatched(start, self.train.rebatch)[1], plain[1], self.group)
            self._figure(verify.NOISE_METRIC, floor)
        if TILED in self.names and verify.needs_noise_floor(FRAMEWORK.name, self.dtype):
            reference = self.fp32_head_reference(start)
        failed = self.compare(patched[1], plain[1], floor, reference)
        results, grads, end = plain if failed else patched
        if failed:
            self.unsave()
            results = fit_results(results, self.plain_valid, self.call.get("num_valid_microbatches"))
        for p, g0, g in zip(self.params, before, grads):
            p.grad = g if g0 is None else (g0 if g is None else g0 + g)
        verify.set_rng_state(end)
        return results

    def fp32_head_reference(self, start: Any) -> list | None:
        """Half precision with the tiled loss on: NeMo-RL's unpatched computation with its lm-head in
        fp32 (:mod:`grpo_patches.verify_fp32_head`), its gradient; ``None`` if the head never ran."""
        with fp32_head.fp32_head(self.call["model"]) as calls:
            grads = self.unpatched(start, self.train.remake)[1]
        return grads if calls.count else None

    def _figure(self, key: str, value: float) -> None:
        figures = self.train.figures  # the largest over the call
        figures[key] = max(figures.get(key, value), value)

    def compare(self, patched_grads: list, plain_grads: list, floor: float | None = None,
                reference: list | None = None) -> list[str]:
        """The checks, in the same order on every rank; the options a ``"disable"`` verdict switched off."""
        failed: list[str] = []
        if self.prev:
            verdict = verify.check(FRAMEWORK.name, [SKIP], self.step, "old_logprob_max_abs_diff", self.prev_measured,
                                   verify.tolerance(FRAMEWORK.name, self.dtype), group=self.group,
                                   detail="the detached current log-probs the loss used against the skipped "
                                          "prev-logprob pass")
            self.record(verdict, [SKIP], failed)
        if self.reference:  # judged here: with no reference model built there is no unpatched result to use
            quantity, limit = "reference_loss_max_abs_diff", verify.tolerance(FRAMEWORK.name, self.dtype)
            measured = verify.agree({quantity: self.reference_measured}, self.group)[quantity]
            failure = None if measured <= limit else f"step {self.step}: {SKIP}: {quantity} = {measured:.3e} > {limit:.3e}"
            verify_log.record(FRAMEWORK.name, self.step, quantity, measured, failure)
            if failure is not None:  # "raise" and "disable" alike
                raise ExactnessError(FRAMEWORK.name, (SKIP,), self.step, quantity, measured, limit,
                                     "the loss reads the skipped reference pass's zero placeholder; it cannot be "
                                     "switched off mid-run (no reference model was built): restart with "
                                     "logprob_skip=False")
            self.record(verify.Verdict(True, measured, limit, {verify.METRIC_PREFIX + quantity: measured}), [SKIP],
                        failed)
        if self.names and not failed and reference is None:
            verdict = verify_gradients.judge_gradients(FRAMEWORK.name, self.names, self.step, patched_grads, plain_grads,
                                             dtype=self.dtype, noise_floor=floor, group=self.group,
                                             detail="the optimizer step's gradient against NeMo-RL's unpatched one")
            self.record(verdict, self.names, failed)
        elif self.names and not failed:
            reference_floor = verify.noise_floor(plain_grads, reference, self.group)
            self._figure(fp32_head.REFERENCE_METRIC, reference_floor)
            verdict = verify_gradients.judge_gradients(
                FRAMEWORK.name, self.names, self.step, patched_grads, plain_grads, group=self.group,
                reference=reference, limit=fp32_head.tolerance(FRAMEWORK.name, self.dtype, reference_floor, floor),
                detail="the optimizer step's gradient against NeMo-RL's unpatched one with its lm-head in fp32")
            self.record(verdict, self.names, failed)
        return failed

    def record(self, verdict: verify.Verdict, names: list[str], failed: list[str]) -> None:
        for key, value in verdict.metrics.items():
            self._figure(key, value)
        if verdict.ok:
            return
        failed.extend(names)
        for name in names:
            self.train.switched_off[name] = verdict.reason
        self.train.filter_on = self.train.filter_on and FILTER not in names
        self.train.tiled_on = self.train.tiled_on and TILED not in names

    def unsave(self) -> None:
        """The unpatched result is used: the filter saved nothing on this global batch."""
        current = self.train.current
        if current is not None:
            for name in COUNTERS:
                setattr(self.train, name, getattr(self.train, name) - getattr(current, name))
            self.train.current = None
