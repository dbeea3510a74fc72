"""Data-parallel tests on spawned gloo processes: a free port, each rank's environment, and the
spawn that waits (with a deadline: a rank left waiting in a collective fails the test, never
hangs it) and loads what each rank saved as ``rank<r>.pt`` in ``out_dir``."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any, Callable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank: int, port: int, world: int) -> None:
    """What torch.distributed and Accelerate read to make this process rank ``rank`` (1 thread each)."""
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)


def run_ranks(worker: Callable[..., None], args: tuple, world: int, out_dir: str | Path, timeout: float,
              what: str = "the ranks") -> list[Any]:
    """``worker(rank, *args)`` on ``world`` spawned processes; each saves ``out_dir/rank<r>.pt``."""
    import pytest
    import torch
    import torch.multiprocessing as mp

    context = mp.spawn(worker, args=args, nprocs=world, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{what} did not finish in {timeout:.0f} s (a rank waiting in a collective?)")
    return [torch.load(Path(out_dir) / f"rank{rank}.pt") for rank in range(world)]


def finish_rank(out_dir: str | Path, rank: int, result: Any) -> None:
    """Save what this rank found (``out_dir/rank<r>.pt``) and leave the process group."""
    import torch
    import torch.distributed as dist

    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks_on_the_tiny_model(worker: Callable[..., None], out_dir: Path, world: int, timeout: float) -> list[Any]:
    """``worker(rank, port, out_dir, model_path)`` on ``world`` ranks, the demo's tiny model
    saved once before they start (so that no rank writes it while another reads it)."""
    from grpo_patches.demo import tiny_model

    model = tiny_model.tiny_model_path(out_dir / "model")
    return run_ranks(worker, (free_port(), str(out_dir), model), world, out_dir, timeout)
