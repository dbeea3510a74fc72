"""Verify mode on verl's FSDP engine (0.8+; :mod:`.verify`): ``FSDPEngine.forward_backward_batch``.

The record (option ``verify_every``, the outermost on that method) counts the training calls,
one per optimizer step (``train_batch``: zero_grad, ``forward_backward_batch``, step), and on
the steps :func:`grpo_patches.verify.due` picks runs :class:`EngineStep`:

1. a skipped old-logprob pass (the update's old log-probs are the placeholder): verl's pass
   really runs on the mini-batch, forward only, the model in eval mode, before the update;
2. the patched computation as without verification; the loss's old log-probs (the detached
   current ones) are compared with the pass where the loss reads them
   (:mod:`.verify_old_logprobs`): ``grpo_patches/verify/old_logprob_max_abs_diff``;
3. verl's own computation, from the same random state, with every record passing through
   (``FRAMEWORK.unpatched()``) on the inputs unpatched verl has: the pass's old log-probs, the entropies
   only if verl asked for them, and, when the reference pass was skipped (KL coefficient 0),
   the KL term with the old log-probs standing in for the reference log-probs (the reference
   model was never built; the term is multiplied by 0, so any finite values prove the point).
   Its loss is also computed without the KL term on the same forward:
   ``grpo_patches/verify/reference_loss_abs_diff``;
4. the mini-batch's gradient, patched vs verl's (``.grad`` as each run's own backward left it,
   FSDP's reduce-scatter included): ``grpo_patches/verify/grad_rel_diff`` (relative L2). In
   bf16 / fp16 verl's computation runs once more, re-batched, for the noise floor the tolerance
   is 10 times of (``grpo_patches/verify/grad_noise_floor``, :func:`grpo_patches.verify.tolerance`);
   with the tiled loss on, once more with its lm-head in fp32 (:mod:`grpo_patches.verify_fp32_head`,
   :mod:`.verify_fp32_head`): the patched gradient is then measured from that reference, within
   the larger of 2 x verl's own distance from it (``grpo_patches/verify/grad_reference_floor``) and
   10 x the floor (the tiled loss rounds less than verl's bf16 logits: never a difference).

The step then leaves ``.grad``, the random state, the savings totals and the output (verl's
metrics) as the chosen computation left them, plus the figures in verl's metrics (one value
per mini-batch, as verl logs its own). ``"raise"`` raises before the optimizer step;
``"disable"`` keeps verl's result and switches the options off (the trainer learns it from the
metrics: :mod:`.verify`). The skipped reference pass cannot come back within a run (no
reference model was built): a difference there raises with either action.

The patched run's loss calls report the old log-probs they used into ``UpdateCall.verify``
(:class:`~.state.VerifyCapture`, :mod:`.verify_old_logprobs`). The Megatron engine is not
verified: ``verify_every`` with it raises at its first update (:mod:`.verify_megatron`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from grpo_patches import verify as core
from grpo_patches import verify_fp32_head as fp32_head
from grpo_patches.call_args import bind
from grpo_patches.errors import ExactnessError
from grpo_patches.savings_totals import add_to_totals, reset as reset_totals, totals

from . import FRAMEWORK, placeholders, state
from . import verify as shared
from .calls_engine import actor_config_of
from .verify_old_logprobs import PASS_FIELD


def forward_backward_batch(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``FSDPEngine.forward_backward_batch(data, loss_function, forward_only)``."""
    call = bind(wrapped, args, kwargs)
    data, loss_function = call["data"], call["loss_function"]
    config = actor_config_of(loss_function)
    if instance is None or call["forward_only"] or config is None or "advantages" not in data.keys():
        return wrapped(*args, **kwargs)
    step = shared.next_step(instance)
    if not FRAMEWORK.verify_due(step):
        return wrapped(*args, **kwargs)
    return EngineStep(wrapped, instance, data, loss_function, config, step).run()


def compute_dtype(engine: Any) -> Any:
    """The dtype the engine computes in (FSDP's ``mixed_precision.param_dtype``; fp32 when unknown)."""
    import torch

    mixed = getattr(getattr(engine, "engine_config", None), "mixed_precision", None) or {}
    name = str(mixed.get("param_dtype", "fp32") if hasattr(mixed, "get") else "fp32").replace("torch.", "")
    return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
            "float16": torch.float16}.get(name, torch.float32)


class EngineStep:
    """One verify step on the engine (module docstring)."""

    def __init__(self, wrapped: Callable[..., Any], engine: Any, data: Any, loss_function: Any, config: Any,
                 step: int) -> None:
        self.wrapped, self.engine, self.data, self.loss_function = wrapped, engine, data, loss_function
        self.config, self.step = config, step
        self.params = list(engine.module.parameters())
        self.group = engine.get_data_parallel_group()
        self.dtype = compute_dtype(engine)
        from .reference import zero_coefficient

        self.on_policy = state.update().on_policy  # the worker substitutes a skipped pass on this update
        self.substituted = self.on_policy is not None and "old_log_probs" in data.keys() \
            and placeholders.present(data["old_log_probs"])
        self.reference_skipped = zero_coefficient(config) and "ref_log_prob" not in data.keys()
        self.figures: dict[str, float] = {}

    def run(self) -> Any:
        from verl.utils import tensordict_utils as tu

        start_rng, start_grads = core.rng_state(), shared.copies(shared.grads(self.params))
        start_totals = totals(FRAMEWORK.name)
        old = self.old_logprob_pass() if self.substituted else None
        patched_data = self.data.copy()
        if old is not None:
            patched_data[PASS_FIELD] = old
        capture = state.VerifyCapture(self.engine)
        with state.in_update(verify=capture):
            out_p = self.wrapped(patched_data, self.loss_function, False)
        diffs = capture.old_logprob_diffs
        names = shared.optimizations_on(self.engine)
        if not (names or self.substituted or self.reference_skipped):
            return out_p  # nothing changed work on this step: nothing to compare
        grads_p, rng_p = shared.grads(self.params), core.rng_state()

        shared.set_grads(self.params, shared.copies(start_grads))
        core.set_rng_state(start_rng)
        upstream = self.data.copy()
        if old is not None:
            upstream["old_log_probs"] = old
            if self.on_policy.forced_entropy:  # verl did not ask for entropies: the substitution did
                tu.assign_non_tensor(upstream, calculate_entropy=False)
        loss_function, without_kl = self.loss_function, []
        if self.reference_skipped:
            upstream["ref_log_prob"] = upstream["old_log_probs"]
            loss_function = self._loss_with_and_without_kl(without_kl)
        with FRAMEWORK.unpatched():
            out_u = self.wrapped(upstream, loss_function, False)
        grads_u, rng_u = shared.grads(self.params), core.rng_state()
        floor = self._noise_floor(upstream, grads_u, start_grads, start_rng) \
            if core.needs_noise_floor(FRAMEWORK.name, self.dtype) else None
        reference = self._fp32_head_reference(upstream, start_grads, start_rng) \
            if "tiled_loss" in names and floor is not None else None

        verdicts = []  # (verdict, the options it covers)
        if self.substituted:
            verdicts.append(self._check(["logprob_skip"], "old_logprob_max_abs_diff", max(diffs, default=0.0),
                                        "the old log-probs the loss used (the current ones, detached) against "
                                        "verl's old-logprob pass on the same weights"))
        if self.reference_skipped:
            verdict, _ = self._check(["logprob_skip"], "reference_loss_abs_diff", max(without_kl, default=0.0),
                                     "verl's loss with the KL term at coefficient 0 against without it")
            if not verdict.ok:
                raise ExactnessError(FRAMEWORK.name, ("logprob_skip",), self.step, "reference_loss_abs_diff",
                                     verdict.measured, verdict.tolerance,
                                     "the reference model was not built and cannot come back within this run: "
                                     "restart with logprob_skip=False")
            verdicts.append((verdict, ["logprob_skip"]))
        grad_names = names + (["logprob_skip"] if self.substituted or self.reference_skipped else [])
        if reference is None:
            verdicts.append(self._check(grad_names, "grad_rel_diff", core.rel_l2(grads_p, grads_u),
                                        "the mini-batch's gradient against verl's unpatched update", floor))
        else:
            reference_floor = core.noise_floor(grads_u, reference, self.group)
            self.figures[fp32_head.REFERENCE_METRIC] = reference_floor
            verdicts.append(self._check(grad_names, "grad_rel_diff", core.rel_l2(grads_p, reference),
                                        "the mini-batch's gradient against verl's unpatched update with its lm-head "
                                        "in fp32", limit=fp32_head.tolerance(FRAMEWORK.name, self.dtype,
                                                                             reference_floor, floor)))
        if all(v.ok for v, _ in verdicts):
            shared.set_grads(self.params, grads_p)
            core.set_rng_state(rng_p)
            return self._finish(out_p, [])
        shared.set_grads(self.params, grads_u)  # "disable": verl's own result, from here on verl's own run
        core.set_rng_state(rng_u)
        reset_totals(FRAMEWORK.name)
        add_to_totals(FRAMEWORK.name, start_totals)
        shared.forget_decisions(self.engine)
        return self._finish(out_u, sorted({n for v, names in verdicts if not v.ok for n in names}))

    def _noise_floor(self, upstream: Any, grads_u: list, start_grads: list, start_rng: Any) -> float:
        """Half precision: verl's unpatched computation again, re-batched (one row per
        micro-batch: the engine normalises the loss by the global batch, so only the rounding
        changes), against the first one. The caller then sets ``.grad`` and the random state."""
        from verl.utils import tensordict_utils as tu

        again = upstream.copy()
        tu.assign_non_tensor(again, use_dynamic_bsz=False, micro_batch_size_per_gpu=1)
        shared.set_grads(self.params, shared.copies(start_grads))
        core.set_rng_state(start_rng)
        loss_function = self._loss_with_and_without_kl([]) if self.reference_skipped else self.loss_function
        with FRAMEWORK.unpatched():
            self.wrapped(again, loss_function, False)
        floor = core.noise_floor(shared.grads(self.params), grads_u, self.group)
        self.figures[core.NOISE_METRIC] = floor
        return floor

    def _fp32_head_reference(self, upstream: Any, start_grads: list, start_rng: Any) -> list | None:
        """Half precision with the tiled loss on: verl's unpatched computation with its lm-head in
        fp32 (:mod:`grpo_patches.verify_fp32_head`), its gradient; ``None`` when verl never called the
        head (fused kernels take its weight themselves). The caller then sets ``.grad`` and the random state."""
        shared.set_grads(self.params, shared.copies(start_grads))
        core.set_rng_state(start_rng)
        loss_function = self._loss_with_and_without_kl([]) if self.reference_skipped else self.loss_function
        with FRAMEWORK.unpatched(), fp32_head.fp32_head(self.engine.module) as calls:
            self.wrapped(upstream, loss_function, False)
        return shared.grads(self.params) if calls.count else None

    def _check(self, names: list[str], quantity: str, measured: float, detail: str,
               floor: float | None = None, limit: float | None = None) -> tuple:
        limit = core.tolerance(FRAMEWORK.name, self.dtype, floor) if limit is None else limit
        verdict = core.check(FRAMEWORK.name, names, self.step, quantity, measured, limit, group=self.group, detail=detail)
        self.figures.update(verdict.metrics)
        return verdict, names

    def _finish(self, output: Any, switched_off: list[str]) -> Any:
        metrics = output["metrics"]
        shared.add_figures(metrics, self.figures)
        shared.mark_switched_off(metrics, switched_off)
        return output

    def old_logprob_pass(self) -> Any:
        """verl's old-logprob pass on this mini-batch (forward only, eval mode, every record
        passing through), in the layout of the update's ``old_log_probs``."""
        import torch
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        data = self.data.copy()
        tu.assign_non_tensor(data, calculate_entropy=False)
        module = self.engine.module
        training = module.training
        with core.preserved_rng(), torch.no_grad(), FRAMEWORK.unpatched():
            module.eval()
            try:
                out = self.engine.forward_backward_batch(data, None, forward_only=True)
            finally:
                module.train(training)
        padded = no_padding_2_padding(out["model_output"]["log_probs"], data).detach().float()
        old = self.data["old_log_probs"]
        if not getattr(old, "is_nested", False):
            return padded.to(old.device)
        lengths = old.offsets().diff().tolist()
        values = torch.cat([padded[i, :n] for i, n in enumerate(lengths)]).to(old.values().device)
        return torch.nested.nested_tensor_from_jagged(values, offsets=old.offsets())

    def _loss_with_and_without_kl(self, differences: list) -> Any:
        """verl's loss (KL term on, coefficient 0) that also records how much it differs from
        the same loss without the KL term, on the same forward."""
        from .reference import without_kl_loss

        loss_function = self.loss_function
        without = functools.partial(loss_function.func, *loss_function.args,
                                    **{**loss_function.keywords, "config": without_kl_loss(self.config)})

        @functools.wraps(loss_function.func)
        def both(*args: Any, **kwargs: Any) -> Any:
            loss, metrics = loss_function(*args, **kwargs)
            other, _ = without(*args, **kwargs)
            differences.append(core.max_abs_diff(loss.detach().reshape(1), other.detach().reshape(1)))
            return loss, metrics

        return both
