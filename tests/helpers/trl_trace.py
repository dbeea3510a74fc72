"""What a TRL training run leaves besides weights and logs, for the "verify leaves no trace" tests
(``tests/test_trl_verify.py``, ``tests/test_trl_verify_bf16.py``)."""

from __future__ import annotations

import copy
import random

import torch

#: log entries that are wall-clock times, different in any two runs
TIMES = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


class Tracer:
    """What a training run leaves besides weights and logs, per optimizer step: the accumulated
    gradients before the update, then the optimizer state, the random states and the step
    counters (HF's ``global_step``, TRL's micro-step ``_step``)."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        self.trainer, self.grads, self.after = None, [], []
        tracer = self

        class Callback(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                tracer.grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])

            def on_step_end(self, args, state, control, optimizer=None, **kwargs):
                import numpy

                tracer.after.append(dict(
                    optimizer=copy.deepcopy(optimizer.state_dict()["state"]), torch_rng=torch.get_rng_state(),
                    python_rng=random.getstate(), numpy_rng=numpy.random.get_state()[1].copy(),
                    global_step=state.global_step, micro_step=tracer.trainer._step))

        self.callback = Callback()

    def hook(self, trainer) -> None:
        self.trainer = trainer


def same(a, b) -> bool:
    """Bitwise equality of nested tensors / arrays / containers."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if hasattr(a, "shape"):  # numpy
        return bool((a == b).all())
    return a == b
