"""Verify mode on verl's legacy ``DataParallelPPOActor`` (0.6.1-0.7.x; :mod:`.verify`).

``update_policy(data)`` runs every mini-batch and epoch of a rollout batch with the optimizer
steps inside it, so a verify step is the whole update run twice (records on ``update_policy``,
outermost, and ``_optimizer_step``, option ``verify_every``), when any of its optimizer steps
is due (:func:`grpo_patches.verify.due`, steps counted 0-based per actor):

1. verl's own update first, every record passing through (``FRAMEWORK.unpatched()``), on the inputs
   unpatched verl has (a skipped reference pass: the old log-probs stand in for the reference
   log-probs under the KL term at coefficient 0); the gradient before each optimizer step is
   kept, and the state it ends in (weights, optimizer state, random state);
2. the weights, optimizer state, gradients and random state put back, then the patched update;
   before each of its optimizer steps its gradient is compared with verl's of the same step
   (``grpo_patches/verify/grad_rel_diff``, relative L2, one all-reduce per step): ``"raise"``
   raises before that step's update; ``"disable"`` stops the patched update and leaves the
   actor as verl's own update left it (its metrics too), the options switched off.

With the tiled loss in bf16 / fp16 two more updates run (:mod:`grpo_patches.verify_fp32_head`):
verl's with its lm-head in fp32, and the patched one with verl's lm-head in fp32 in place of the
tiled loss. Before each optimizer step the tiled loss alone is checked first: the patched gradient
against the second, within 2 x verl's own bf16 distance from the first
(``grpo_patches/verify/tiled_grad_rel_diff``; ``grad_reference_floor``): the rows lie alike in
both, so only the head differs. Then the whole update, as below but measured from the first,
within the larger of 2 x that distance and 10 x the epsilon: the tiled loss rounds less than
verl's bf16 logits, which is never a difference.

In bf16 / fp16 the tolerance is 10 x the dtype's epsilon (:func:`grpo_patches.verify.tolerance`
without a floor), not a measured noise floor: this actor's loss is a token mean per micro-batch
scaled by ``1/gradient_accumulation``, so verl has no re-batched computation of the same
gradient, and one that keeps every micro-batch (rows reversed within each) rounds alike: on the
tiny model in bf16 its floor was ~0 while the filter's legitimate re-packing (each kept row
weighted by its original micro-batch's ``1/(M·D_m)``) differed by 3.2e-3 and 6.0e-3 on its two
optimizer steps, close to even the floor's lower bound (a tenth of the epsilon: 7.8e-3).
Reversing the micro-batches too is no repeat: verl splits the reversed rows into other
micro-batches when the last one is short (measured: 0.55 in fp32).

A skipped old-logprob pass (0.7) needs no comparison of its own here: verl's legacy actor
ignores old log-probs on the one-mini-batch, one-epoch updates the skip is limited to
(``old_log_prob = log_prob.detach()``), so the loss uses the same values patched or not; the
gradient comparison covers the rest. Cost: two updates, plus copies of the weights and the
optimizer state (the unpatched end state is kept until the patched update has passed); four
updates with the tiled loss in half precision.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

from grpo_patches import verify as core
from grpo_patches import verify_fp32_head as fp32_head
from grpo_patches.call_args import bind
from grpo_patches.savings_totals import add_to_totals, reset as reset_totals, totals

from . import FRAMEWORK, state, tiled
from . import verify as shared


class _UseVerls(Exception):
    """The patched update stops: a check failed with ``verify_action="disable"``."""


@dataclass
class _State:
    params: list
    grads: list
    optimizer: dict
    rng: Any


def update_policy(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``DataParallelPPOActor.update_policy(data)``."""
    if instance is None or instance.actor_optimizer is None or state.update().verify is not None:
        return wrapped(*args, **kwargs)
    data = bind(wrapped, args, kwargs)["data"]
    config = instance.config
    steps = -(-len(data) // config.ppo_mini_batch_size) * int(config.ppo_epochs)
    first = shared.next_step(instance)
    state.of(instance).optimizer_steps = first + steps
    if not any(FRAMEWORK.verify_due(s) for s in range(first, first + steps)):
        return wrapped(*args, **kwargs)
    return LegacyStep(wrapped, instance, data, args, kwargs, first).run()


def optimizer_step(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``DataParallelPPOActor._optimizer_step()``: keep or compare the gradient."""
    capture = state.update().verify
    if capture is None or capture.actor is not instance:
        return wrapped(*args, **kwargs)
    params = list(instance.actor_module.parameters())
    if capture.compare is None:  # verl's run: keep its gradient
        capture.grads.append(shared.copies(shared.grads(params)))
    else:  # the patched run: compare with verl's of the same step
        capture.grads.append(None)
        capture.compare(len(capture.grads) - 1, shared.grads(params))
    return wrapped(*args, **kwargs)


class LegacyStep:
    """One verified ``update_policy`` call (module docstring)."""

    def __init__(self, wrapped: Callable[..., Any], actor: Any, data: Any, args: tuple, kwargs: dict,
                 first: int) -> None:
        import torch.distributed as dist

        self.wrapped, self.actor, self.data, self.args, self.kwargs, self.first = wrapped, actor, data, args, kwargs, first
        self.params = list(actor.actor_module.parameters())
        self.group = None if not (dist.is_available() and dist.is_initialized()) else dist.group.WORLD
        from .reference import zero_coefficient

        self.reference_skipped = zero_coefficient(actor.config) and "ref_log_prob" not in data.batch.keys()
        self.figures: list[float] = []
        self.reference_floors: list[float] = []
        self.failed: list[str] = []
        self.reference: list = []
        self.fp32_head: list | None = None
        self.tiled_aside: list | None = None
        self.tiled_figures: list[float] = []

    def _state(self) -> _State:
        return _State([p.detach().clone() for p in self.params], shared.copies(shared.grads(self.params)),
                      copy.deepcopy(self.actor.actor_optimizer.state_dict()), core.rng_state())

    def _restore(self, state: _State) -> None:
        import torch

        with torch.no_grad():
            for p, saved in zip(self.params, state.params):
                p.copy_(saved)
        shared.set_grads(self.params, shared.copies(state.grads))
        self.actor.actor_optimizer.load_state_dict(copy.deepcopy(state.optimizer))
        core.set_rng_state(state.rng)

    def _data_copy(self) -> Any:
        """The update's data, shallow (its own batch dict): an extra update leaves the real one's input as it was."""
        data = copy.copy(self.data)
        data.batch = self.data.batch.clone(False)  # verl's update only reads its tensors
        return data

    def _verls_inputs(self) -> Any:
        data = self._data_copy()
        if self.reference_skipped:
            data.batch["ref_log_prob"] = data.batch["old_log_probs"]
        return data

    def run(self) -> Any:
        start, start_totals = self._state(), totals(FRAMEWORK.name)
        verls = state.VerifyCapture(self.actor)
        with state.in_update(verify=verls), FRAMEWORK.unpatched():
            out_u = self.wrapped(self._verls_inputs())
        self.reference = verls.grads
        end_u = self._state()
        self._restore(start)
        if tiled.enabled() and core.needs_noise_floor(FRAMEWORK.name, _dtype(self.actor)):  # decided in the update
            self.fp32_head = self._fp32_head_reference()
            self._restore(start)
            if self.fp32_head is not None:
                self.tiled_aside = self._tiled_aside_reference()
                self._restore(start)
                reset_totals(FRAMEWORK.name)
                add_to_totals(FRAMEWORK.name, start_totals)
        try:
            with state.in_update(verify=state.VerifyCapture(self.actor, compare=self.compare)):
                out_p = self.wrapped(*self.args, **self.kwargs)
        except _UseVerls:
            self._restore(end_u)
            reset_totals(FRAMEWORK.name)
            add_to_totals(FRAMEWORK.name, start_totals)
            shared.forget_decisions(self.actor)
            return self._finish(out_u, sorted(set(self.failed)))
        return self._finish(out_p, [])

    def _fp32_head_reference(self) -> list | None:
        """verl's update again with its lm-head in fp32 (:mod:`grpo_patches.verify_fp32_head`): the
        gradient before each optimizer step; ``None`` if the head never ran in fp32."""
        capture = state.VerifyCapture(self.actor)
        with state.in_update(verify=capture), FRAMEWORK.unpatched(), \
                fp32_head.fp32_head(self.actor.actor_module) as calls:
            self.wrapped(self._verls_inputs())
        return capture.grads if calls.count else None

    def _tiled_aside_reference(self) -> list:
        """The patched update again with its tiled loss stepping aside for verl's lm-head in fp32: the
        reference of the tiled loss alone, the rows laid out as the other optimizations lay them out
        (the gradient before each optimizer step; the caller puts the state and savings back)."""
        capture = state.VerifyCapture(self.actor)
        with state.in_update(verify=capture), fp32_head.fp32_head(self.actor.actor_module, tiled_aside=True):
            self.wrapped(self._data_copy())
        return capture.grads

    def names(self) -> list[str]:
        return shared.optimizations_on(self.actor) + (["logprob_skip"] if self.reference_skipped else [])

    def compare(self, index: int, grads: list) -> None:
        """The patched update's gradient before optimizer step ``index`` against verl's (every rank alike)."""
        names, dtype = self.names(), _dtype(self.actor)
        against, limit = self.reference[index], core.tolerance(FRAMEWORK.name, dtype)
        detail = "the optimizer step's gradient against verl's unpatched update_policy"
        if self.fp32_head is not None and "tiled_loss" in names:  # in half precision: against verl's, lm-head in fp32
            against = self.fp32_head[index]
            floor = core.noise_floor(self.reference[index], against, self.group)
            self.reference_floors.append(floor)
            if self.tiled_aside is not None:
                self._check_tiled_alone(index, grads, dtype, floor)
            limit, detail = fp32_head.tolerance(FRAMEWORK.name, dtype, floor, None), detail + " with its lm-head in fp32"
        verdict = core.check(FRAMEWORK.name, names, self.first + index, "grad_rel_diff", core.rel_l2(grads, against),
                             limit, group=self.group, detail=detail)
        self.figures.append(verdict.measured)
        if not verdict.ok:
            self.failed.extend(names)
            raise _UseVerls()

    def _check_tiled_alone(self, index: int, grads: list, dtype: Any, floor: float) -> None:
        """The tiled loss alone: the patched gradient against the same update with verl's lm-head in fp32
        in its place, within 2 x verl's own bf16 distance from its fp32-head reference (a correct tiled
        loss is an fp32 head: no farther than verl's own rounding; this actor's re-packed rows round
        alike in both, so the bound is tight where the whole update's cannot be)."""
        verdict = core.check(FRAMEWORK.name, ["tiled_loss"], self.first + index, "tiled_grad_rel_diff",
                             core.rel_l2(grads, self.tiled_aside[index]),
                             core.tolerance(FRAMEWORK.name, dtype, floor, reference=True), group=self.group,
                             detail="the optimizer step's gradient against the same patched update with verl's "
                                    "lm-head in fp32 in place of the tiled loss")
        self.tiled_figures.append(verdict.measured)
        if not verdict.ok:
            self.failed.append("tiled_loss")
            raise _UseVerls()

    def _finish(self, out: dict, switched_off: list[str]) -> dict:
        if self.tiled_figures:
            out[core.METRIC_PREFIX + "tiled_grad_rel_diff"] = list(self.tiled_figures)
        if self.figures:
            out[core.METRIC_PREFIX + "grad_rel_diff"] = list(self.figures)
        if self.reference_floors:
            out[fp32_head.REFERENCE_METRIC] = list(self.reference_floors)
        shared.mark_switched_off(out, switched_off)
        return out


def _dtype(actor: Any) -> Any:
    """The dtype the actor computes in (its parameters'; FSDP1's mixed precision param dtype when set)."""
    mixed = getattr(actor.actor_module, "mixed_precision", None)
    param_dtype = getattr(mixed, "param_dtype", None)
    if param_dtype is not None:
        return param_dtype
    return next(iter(actor.actor_module.parameters())).dtype
