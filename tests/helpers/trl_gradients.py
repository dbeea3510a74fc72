"""Per-optimizer-step gradients of a TRL run, and their relative L2 difference (the packing tests)."""

from __future__ import annotations

import math


class Gradients:
    """Records every optimizer step's gradient (a TrainerCallback, before the optimizer steps)."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        self.steps: list[dict] = []
        outer = self

        class Callback(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
                outer.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                                    if p.grad is not None})

        self.callback = Callback()


def rel_l2(a: dict, b: dict) -> float:
    """Relative L2 distance of two gradient dicts (over every parameter together)."""
    num = math.sqrt(sum(float((a[k] - b[k]).double().pow(2).sum()) for k in a))
    den = math.sqrt(sum(float(b[k].double().pow(2).sum()) for k in b))
    return num / den if den else num
