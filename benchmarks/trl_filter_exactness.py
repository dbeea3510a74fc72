"""How exact is the TRL zero-advantage filter? One optimizer step's gradient, filter off vs on.

The tiny model (:mod:`grpo_patches_testing.trl_train`: TRL 1.16 GRPOTrainer, GA=3, steps_per_generation=2, half the
prompts with identical rewards), one SGD step, the accumulated gradient before the optimizer
step (``max_grad_norm=0``), relative L2 over all parameters, in fp32 and with ``bf16=True``
(GRPOConfig's default, autocast on CPU). Next to it, the noise of merely re-batching the same
rows unpatched (micro-batches of 2 instead of 4, twice the accumulation steps and
steps_per_generation: the same rollouts and rows per optimizer step, other summation orders):
the filter's deviation is of that size, which is why "bitwise identical" is a property of
a run (the demo's) and not a guarantee.

    python benchmarks/trl_filter_exactness.py                 # ~1-3 min on 2 cores; prints a table
    python benchmarks/trl_filter_exactness.py --device cuda   # the same on a GPU (CUDA's bf16 GEMMs)
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
from transformers import TrainerCallback

from grpo_patches.demo import tiny_model
from grpo_patches_testing.trl_train import train

OFF = dict(recompute=False, logprob_skip=False, zero_advantage_filter=False, tiled_loss=False)
COMMON = dict(steps=1, reward_funcs=tiny_model.reward_constant_per_prompt, optim="sgd", max_grad_norm=0.0)
REBATCHED = dict(per_device_train_batch_size=2, gradient_accumulation_steps=6, steps_per_generation=4)


class StepGradient(TrainerCallback):
    """The first optimizer step's accumulated gradient and the completions it used."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] | None = None
        self.completions: list[torch.Tensor] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}

    def spy(self, trainer) -> None:
        compute_loss = trainer.compute_loss

        def spied(model, inputs, *args, **kwargs):
            if self.grads is None:
                self.completions.append(inputs["completion_ids"].clone())
            return compute_loss(model, inputs, *args, **kwargs)

        trainer.compute_loss = spied


def step(filter_on: bool, bf16: bool, **config: object) -> StepGradient:
    capture = StepGradient()
    options = dict(OFF, zero_advantage_filter=True) if filter_on else None
    train(filter_on, options, bf16=bf16, callbacks=[capture], trainer_hook=capture.spy, **COMMON, **config)
    return capture


def rel_l2(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    diff = sum(float((grads[n] - ref[n]).norm() ** 2) for n in ref)
    return (diff / sum(float(r.norm() ** 2) for r in ref.values())) ** 0.5


def same_rows(a: StepGradient, b: StepGradient) -> bool:
    return torch.equal(torch.cat([c.flatten() for c in a.completions]), torch.cat([c.flatten() for c in b.completions]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where TRL trains (default: cpu)")
    device = parser.parse_args().device
    COMMON["use_cpu"] = device == "cpu"
    print(f"One SGD step, TRL GRPOTrainer, tiny Qwen2, {device} ({datetime.date.today().isoformat()}); "
          "relative L2 of the step gradient vs unpatched with the same settings\n")
    print("| precision | filter on vs off | re-batched, unpatched | same rows |")
    print("|---|---|---|---|")
    for bf16 in (False, True):
        ref, filtered, rebatched = step(False, bf16), step(True, bf16), step(False, bf16, **REBATCHED)
        same = same_rows(ref, filtered) and same_rows(ref, rebatched)
        print(f"| {'bf16 autocast' if bf16 else 'fp32'} | {rel_l2(filtered.grads, ref.grads):.1e} "
              f"| {rel_l2(rebatched.grads, ref.grads):.1e} | {'yes' if same else 'NO'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
