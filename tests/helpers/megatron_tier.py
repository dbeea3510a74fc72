"""The Megatron cells' two tiers, shared by the verl and NeMo-RL Megatron harnesses (tests only).

* cpu tier: fp32 on gloo through :mod:`tests.helpers.megatron_cpu_shim` (megatron-core's local layers);
  patched vs unpatched gradients equal to :data:`FP32_TOL`.
* gpu tier (``GRPO_PATCHES_TIER=gpu`` on a CUDA machine): bf16 on NCCL, Transformer Engine layers where
  TE is installed; bf16 rounding makes any change of micro-batching move the gradient, so a cell compares
  with the noise floor: twice the change that re-batching the same rows makes unpatched (:func:`tolerance`).
"""

from __future__ import annotations

import importlib.util
import os
import socket

import torch

GPU = os.environ.get("GRPO_PATCHES_TIER") == "gpu" and torch.cuda.is_available()
#: bf16 compared with the noise floor: the gpu tier; ``GRPO_PATCHES_MEGATRON_BF16=1`` runs the NeMo-RL Megatron
#: cell's bf16 comparisons on a CPU too (local layers, gloo): a check of the gpu tier's test code without a GPU
BF16 = GPU or os.environ.get("GRPO_PATCHES_MEGATRON_BF16") == "1"
#: patched vs unpatched, relative gradient difference, fp32 (the cpu tier)
FP32_TOL = 1e-6


def tolerance(noise: float = 0.0) -> float:
    """What a patched run may differ from the unpatched one: twice ``noise`` (the difference that merely
    re-batching the same rows makes unpatched; 0 in fp32, where nothing is measured), never below 1e-6."""
    return max(FP32_TOL, 2 * noise)


def te_installed() -> bool:
    """Transformer Engine's PyTorch package is importable (the gpu tier installs it)."""
    try:
        return importlib.util.find_spec("transformer_engine.pytorch") is not None
    except ModuleNotFoundError:  # no ``transformer_engine`` parent package
        return False


def use_te() -> bool:
    """Build Transformer Engine layers: on the gpu tier where TE is installed (CPU: local layers)."""
    return GPU and te_installed()


def skip_unless_gpus(count: int) -> None:
    """On the gpu tier, skip (under pytest) a case that needs ``count`` GPUs the machine lacks; the cpu
    tier runs it on gloo."""
    if GPU and torch.cuda.device_count() < count:
        import pytest

        pytest.skip(f"not run: {count} processes need {count} GPUs on the gpu tier")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_nccl(rank: int = 0, world: int = 1, port: int | None = None) -> None:
    """An NCCL group, one GPU per rank (the gpu tier's counterpart of the harnesses' gloo groups)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or free_port()), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl", rank=rank, world_size=world)
