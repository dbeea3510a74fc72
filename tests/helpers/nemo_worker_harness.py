"""Runs a NeMo-RL DTensor worker's ``train()`` the same way on the stand-in and on the real source.

``run_train`` builds a fresh model, loss and worker, trains one call and returns the
gradient of every optimizer step, the metrics NeMo-RL returns and how many rows went through
the model. The stand-in builds its worker directly (:mod:`tests.helpers.nemo_fake`); the real-source
tests pass their own ``make_worker`` (:func:`grpo_patches_testing.nemo_rl_cpu.real_worker`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch

from grpo_patches_testing.nemo_rl_tags import make_loss, worker_class  # noqa: F401  (the tests read make_loss here)

ZERO_ROWS = (1, 2, 5, 8, 9, 10)  # advantage exactly 0 on every token (e.g. all-equal rewards)


def make_batch(rows: int = 12, seq: int = 9, vocab: int = 23, zero_rows=ZERO_ROWS, seed: int = 1,
               prompt: int = 3) -> dict[str, torch.Tensor]:
    """A GRPO batch: right-padded rows, a response mask after the prompt, per-token advantages."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt + 2, seq + 1, (rows,), generator=g)
    pos = torch.arange(seq)[None, :]
    token_mask = ((pos >= prompt) & (pos < lengths[:, None])).float()
    input_ids = torch.where(pos < lengths[:, None], torch.randint(1, vocab, (rows, seq), generator=g), 0)
    row_adv = torch.randn(rows, generator=g)
    row_adv[[r for r in zero_rows if r < rows]] = 0.0
    generation = -torch.rand(rows, seq, generator=g) * 3 * token_mask
    return {
        "input_ids": input_ids,
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": torch.ones(rows),
        "advantages": row_adv[:, None] * token_mask,
        "generation_logprobs": generation,
        "prev_logprobs": generation + 0.05 * torch.randn(rows, seq, generator=g) * token_mask,
        "reference_policy_logprobs": generation + 0.1 * torch.randn(rows, seq, generator=g) * token_mask,
    }


def batched(batch: dict[str, torch.Tensor], micro_batches: list | None = None) -> Any:
    """A ``BatchedDataDict``; ``micro_batches`` = [(start, end, length), ...] for dynamic batching
    (the layout NeMo-RL's driver makes with ``shard_by_batch_size``)."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    data = BatchedDataDict({k: v.clone() for k, v in batch.items()})
    for name in ("micro_batch_indices", "micro_batch_lengths"):  # a layout NeMo-RL's own sharding made
        if getattr(batch, name, None) is not None:
            setattr(data, name, copy.deepcopy(getattr(batch, name)))
    if micro_batches is not None:
        data.micro_batch_indices = [[[s, e] for s, e, _ in micro_batches]]
        data.micro_batch_lengths = [[n for _, _, n in micro_batches]]
    return data


@dataclass
class TrainRun:
    step_grads: list[torch.Tensor]
    metrics: dict[str, list]
    rows_forwarded: int
    worker: Any


def fake_worker(tag: str, gbs: int, mbs: int, *, dynamic: bool = False, temperature: float | None = None,
                tied: bool = False) -> Any:
    """The stand-in's worker with a fresh tiny model (same seed every time)."""
    from nemo_rl.models.tiny import TinyLM

    cfg = {"train_global_batch_size": gbs, "train_micro_batch_size": mbs, "logprob_batch_size": mbs,
           "dynamic_batching": {"enabled": dynamic}, "sequence_packing": {"enabled": False}}
    worker = worker_class(tag)(TinyLM(tied=tied), cfg)
    if temperature is not None:
        worker.sampling_params = _Sampling(temperature)
    return worker


@dataclass
class _Sampling:
    temperature: float
    top_k: int | None = None
    top_p: float = 1.0


def grads_of(model: torch.nn.Module) -> torch.Tensor:
    out = []
    for p in model.parameters():
        grad = p.grad
        if grad is None:
            out.append(torch.zeros(p.numel(), dtype=torch.float64))
            continue
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        out.append(grad.detach().reshape(-1).double())
    return torch.cat(out)


def run_train(tag: str, batch: dict, loss_fn: Any, make_worker: Callable[[], Any],
              micro_batches: list | None = None, eval_mode: bool = False) -> TrainRun:
    """One ``train()`` call; gradients are read just before each optimizer step."""
    worker = make_worker()
    model = worker.model
    grads: list[torch.Tensor] = []
    step = worker.optimizer.step

    def recording_step(*args: Any, **kwargs: Any) -> Any:
        grads.append(grads_of(model))
        return step(*args, **kwargs)

    worker.optimizer.step = recording_step
    rows = [0]

    def count(module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        rows[0] += int(ids.shape[0])

    handle = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        result = worker.train(batched(batch, micro_batches), loss_fn, eval_mode=eval_mode)
    finally:
        handle.remove()
    return TrainRun(grads, result["all_mb_metrics"], rows[0], worker)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / (b.norm() + 1e-30))


def max_grad_rel(a: TrainRun, b: TrainRun) -> float:
    assert len(a.step_grads) == len(b.step_grads) > 0
    return max(rel(x, y) for x, y in zip(a.step_grads, b.step_grads))


def summed(metrics: dict[str, list]) -> dict[str, float]:
    """NeMo-RL's aggregation of the per-micro-batch lists (grpo_train: min / max / mean / sum)."""
    out = {}
    for key, values in metrics.items():
        finite = [float(v) for v in values if abs(float(v)) != float("inf")]
        if "_min" in key:
            out[key] = min(finite) if finite else float("nan")
        elif "_max" in key:
            out[key] = max(finite) if finite else float("nan")
        elif key in ("lr", "wd", "global_valid_seqs", "global_valid_toks"):
            out[key] = float(sum(float(v) for v in values)) / max(len(values), 1)
        else:
            out[key] = float(sum(float(v) for v in values))
    return out
