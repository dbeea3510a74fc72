"""Two data-parallel ranks (spawned processes, gloo, megatron-core DDP) training NeMo-RL's real Megatron worker.

One global batch of 12 rows, 6 per rank (rank r takes rows ``6r .. 6r+5``, as NeMo-RL's driver
shards it); the zero-advantage rows are placed so that rank 0 keeps 3 rows (2 micro-batches of 2)
and rank 1 keeps 1 (1 micro-batch): rank 1 must add a zero-weight micro-batch, or the ranks'
gradient all-reduces would not pair up. Each rank trains unpatched then patched and reports; on the gpu
tier (bf16, NCCL, one GPU a rank) also unpatched with 3 rows a micro-batch: its re-batching noise floor.
"""

from __future__ import annotations

from typing import Any

ZERO_ROWS = (1, 2, 5, 6, 8, 9, 10, 11)


def _rank(rank: int, port: int, queue: Any) -> None:
    try:
        queue.put(_train(rank, port))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        queue.put({"rank": rank, "error": repr(exc)})
        raise


def _train(rank: int, port: int) -> dict:
    import torch

    import grpo_patches
    from grpo_patches_testing.nemo_rl_cpu import tag
    from grpo_patches_testing.nemo_rl_tags import make_loss
    from tests.helpers import megatron_tier, nemo_rl_megatron_harness as harness
    from tests.helpers.nemo_worker_harness import batched, make_batch, rel

    torch.set_num_threads(1)
    harness.setup(rank, 2, port)
    batch = make_batch(rows=12, zero_rows=ZERO_ROWS)
    shard = {k: v[6 * rank:6 * rank + 6] for k, v in batch.items()}

    def train(mbs: int = 2) -> tuple[list, dict, int]:
        worker = harness.real_worker(gbs=12, mbs=mbs, dp=2)
        grads = harness.record_grads(worker)
        rows = [0]

        def count(module: Any, args: tuple, kwargs: dict) -> None:
            if torch.is_grad_enabled():
                rows[0] += int(kwargs["input_ids"].shape[0])

        worker.model.module.register_forward_pre_hook(count, with_kwargs=True)
        result = worker.train(batched(shard), make_loss(tag()))
        return grads, result["all_mb_metrics"], rows[0]

    base_grads, base_metrics, base_rows = train()
    noise = rel(train(mbs=3)[0][0], base_grads[0]) if megatron_tier.BF16 else 0.0  # bf16: re-batching moves it
    grpo_patches.enable("nemo_rl", zero_advantage_filter=True)
    grads, metrics, rows = train()
    assert len(grads) == len(base_grads) == 1
    return {"rank": rank, "grad_rel": rel(grads[0], base_grads[0]), "rows_base": base_rows, "rows_patched": rows,
            "microbatches": len(metrics["loss"]), "microbatches_base": len(base_metrics["loss"]),
            "rows_dropped": metrics["grpo_patches/rows_dropped"][0],
            "tol": megatron_tier.tolerance(noise)}


def run_ranks(context: Any, port: int, timeout: float = 600, target: Any = None, args: tuple = ()) -> list[dict]:
    """Run both ranks (``target(rank, port, *args, queue)``, by default this module's); their reports, rank 0 first."""
    queue = context.Queue()
    procs = [context.Process(target=target or _rank, args=(rank, port, *args, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    results = sorted((queue.get(timeout=timeout) for _ in procs), key=lambda r: r["rank"])
    for proc in procs:
        proc.join(timeout=60)
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors
    return results
