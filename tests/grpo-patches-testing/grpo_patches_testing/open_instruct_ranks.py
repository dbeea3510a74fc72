"""gloo process groups for open-instruct's learner on a CPU: one rank in this process
(:func:`init_gloo`), or each config's :func:`.open_instruct_cpu.train` on spawned ranks
(:func:`train_ranks`)."""

from __future__ import annotations

import io
import os
import queue as queues
import socket
import time
from typing import TYPE_CHECKING, Any

from grpo_patches_testing.open_instruct_deepspeed_op import environment

if TYPE_CHECKING:  # pragma: no cover
    from grpo_patches_testing.open_instruct_cpu import Config
    from grpo_patches_testing.open_instruct_records import Result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int = 0, world_size: int = 1, port: int | None = None) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                init_method=f"tcp://127.0.0.1:{port or free_port()}")


def _rank_main(rank: int, world_size: int, port: int, configs: list[Config], queue: Any) -> None:
    try:
        import torch

        from grpo_patches_testing.open_instruct_cpu import train

        torch.set_num_threads(1)
        init_gloo(rank, world_size, port)
        results = [train(c, rank) for c in configs]
        buffer = io.BytesIO()  # plain bytes: tensors through the queue would go by shared memory, whose
        torch.save(results, buffer)  # file descriptors die with this process before the parent reads them
        queue.put((rank, buffer.getvalue(), None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        queue.put((rank, None, traceback.format_exc()))
        raise


def train_ranks(configs: list[Config], timeout: float = 1800) -> list[list[Result]]:
    """Each config on ``configs[0].world_size`` spawned gloo ranks (all configs in the same
    processes, in order); returns ``results[rank][i]``."""
    import multiprocessing

    world_size = configs[0].world_size
    assert all(c.world_size == world_size for c in configs), "one world size per call"
    os.environ.update(environment())
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, configs, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, list[Result]] = {}
    errors = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size and not errors:
            try:
                rank, results, error = queue.get(timeout=5)
            except queues.Empty:
                dead = [p.exitcode for p in procs if not p.is_alive() and p.exitcode]
                if dead or time.monotonic() > deadline:
                    errors.append(f"a rank died (exit codes {dead}) or timed out without a report")
                continue
            if error:
                errors.append(f"rank {rank}:\n{error}")
            else:
                import torch

                out[rank] = torch.load(io.BytesIO(results), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.terminate()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [out[r] for r in range(world_size)]

