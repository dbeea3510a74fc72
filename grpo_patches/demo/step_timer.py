"""Where a TRL ``GRPOTrainer`` optimizer step spends its time, measured the same way patched or not.

Used by ``grpo-patches demo`` and ``benchmarks/trl_step.py``. Components (wall seconds):

- ``generation``: ``_generate_and_score_completions`` (sampling, rewards, advantages) minus
  the old-logprob passes inside it;
- ``old_logprobs``: no-grad calls of TRL's log-prob method outside the loss, i.e. the
  old-logprob (and reference) passes, counted *beneath* grpo_patches' wrappers, so a pass the
  patches answer without a forward costs nothing here and one they defer is still counted;
- ``policy_forward``: ``compute_loss`` (the policy forward, any no-grad forward of dropped
  rows, and the loss);
- ``backward``: ``accelerator.backward``;
- ``optimizer``: between the HF Trainer's ``on_pre_optimizer_step`` and ``on_optimizer_step``.

``trainer_side`` is everything but generation. Each component is measured in wall seconds
and in process CPU seconds (``cpu_<component>``, every thread's): on a shared machine the wall
time of the same work varies with the other processes' load, its CPU time much less. Rows through the log-prob method are counted
too (``rows``; token positions, rows x columns, in ``tokens``), and the passes that ran (``passes``). Install with :meth:`StepTimer.install` on the class *before*
``grpo_patches.enable`` and :meth:`StepTimer.attach` on the built trainer; per optimizer step
the components are in :attr:`StepTimer.steps`. Imports torch / transformers lazily.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

COMPONENTS = ("generation", "old_logprobs", "policy_forward", "backward", "optimizer")
TRAINER_SIDE = ("old_logprobs", "policy_forward", "backward", "optimizer")


def _sync() -> None:
    """On a GPU, wait for the queued kernels, so that a component's wall time is its own work's."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@dataclass
class StepTimer:
    """Accumulates seconds per component; :attr:`steps` holds one dict per optimizer step."""

    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        (*COMPONENTS, *(f"cpu_{c}" for c in COMPONENTS)), 0.0))
    rows: dict[str, int] = field(default_factory=lambda: {"old_logprobs": 0, "policy_with_grad": 0, "policy_no_grad": 0})
    tokens: dict[str, int] = field(default_factory=lambda: {"old_logprobs": 0, "policy_with_grad": 0})
    passes: dict[str, int] = field(default_factory=lambda: {"old_logprob_passes": 0, "reference_passes": 0})
    #: calls of the log-prob method in the loss with gradients (each one forward and one backward)
    policy_calls: int = 0
    steps: list[dict[str, float]] = field(default_factory=list)
    _in_loss: bool = False
    _optimizer: Any = None
    _last: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def _timed(self, component: str) -> Iterator[None]:
        _sync()
        start, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            _sync()
            self.totals[component] += time.perf_counter() - start
            self.totals[f"cpu_{component}"] += time.process_time() - cpu

    def install(self, trainer_class: type) -> None:
        """Time and count the log-prob method beneath the patches (call before ``enable``)."""
        import torch
        import wrapt

        def logprobs(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
            model = args[0] if args else kwargs.get("model")
            if getattr(model, "runs_no_forward", False):  # an input recorder, not a forward
                return wrapped(*args, **kwargs)
            ids = kwargs["input_ids"] if "input_ids" in kwargs else args[1]
            rows = int(ids.size(0))
            if self._in_loss:
                self.rows["policy_with_grad" if torch.is_grad_enabled() else "policy_no_grad"] += rows
                self.tokens["policy_with_grad"] += int(ids.numel()) if torch.is_grad_enabled() else 0
                self.policy_calls += int(torch.is_grad_enabled())
                return wrapped(*args, **kwargs)
            reference = model is not None and model is getattr(instance, "ref_model", None)
            self.passes["reference_passes" if reference else "old_logprob_passes"] += 1
            self.rows["old_logprobs"] += 0 if reference else rows
            self.tokens["old_logprobs"] += 0 if reference else int(ids.numel())
            with self._timed("old_logprobs"):
                return wrapped(*args, **kwargs)

        wrapt.wrap_function_wrapper(trainer_class, "_get_per_token_logps_and_entropies", logprobs)

    def attach(self, trainer: Any) -> None:
        """Time the built trainer's loss, backward, optimizer and generation (outermost)."""
        from transformers import TrainerCallback

        timer = self
        compute_loss, backward = trainer.compute_loss, trainer.accelerator.backward
        generate = trainer._generate_and_score_completions

        def timed_compute_loss(*args: Any, **kwargs: Any) -> Any:
            timer._in_loss = True
            try:
                with timer._timed("policy_forward"):
                    return compute_loss(*args, **kwargs)
            finally:
                timer._in_loss = False

        def timed_backward(*args: Any, **kwargs: Any) -> Any:
            with timer._timed("backward"):
                return backward(*args, **kwargs)

        def timed_generation(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = timer.totals["old_logprobs"], timer.totals["cpu_old_logprobs"]
            with timer._timed("generation"):
                result = generate(*args, **kwargs)
            timer.totals["generation"] -= timer.totals["old_logprobs"] - wall  # passes inside: their own row
            timer.totals["cpu_generation"] -= timer.totals["cpu_old_logprobs"] - cpu
            return result

        class OptimizerTime(TrainerCallback):
            def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                timer._optimizer = timer._timed("optimizer")
                timer._optimizer.__enter__()

            def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                timer._optimizer.__exit__(None, None, None)

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                timer._close_step()

        trainer.compute_loss = timed_compute_loss
        trainer.accelerator.backward = timed_backward
        trainer._generate_and_score_completions = timed_generation
        trainer.add_callback(OptimizerTime())

    def _close_step(self) -> None:
        step = {name: value - self._last.get(name, 0.0) for name, value in self.totals.items()}
        step["trainer_side"] = sum(step[name] for name in TRAINER_SIDE)
        step["cpu_trainer_side"] = sum(step[f"cpu_{name}"] for name in TRAINER_SIDE)
        self.steps.append(step)
        self._last = dict(self.totals)

    def per_step(self, skip: int = 0) -> dict[str, float]:
        """Mean seconds per optimizer step over the steps after the first ``skip``."""
        timed = self.steps[skip:]
        if not timed:
            return {}
        return {name: sum(s[name] for s in timed) / len(timed) for name in timed[0]}
