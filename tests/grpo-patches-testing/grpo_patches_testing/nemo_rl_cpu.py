"""Running NeMo-RL's real code on a CPU in one process (the real-source cells and ``benchmarks/fw_nemo_rl.py``).

* :func:`setup`: a CPU shim (every ``"cuda"`` placement goes to the CPU, CUDA queries answer
  harmlessly: NeMo-RL calls ``.cuda()`` and ``torch.tensor(..., device="cuda")`` directly),
  v0.6.0's top-level ``megatron.core`` import stubbed, a gloo group of one process.
* :func:`real_worker`: the real ``DTensorPolicyWorkerV2(Impl)`` object built without Ray and
  without its ``__init__`` (which needs GPUs and an Automodel checkpoint), holding a tiny
  Qwen2 (optionally FSDP2-sharded) and the attributes ``train()`` reads; same signature as
  the stand-in's factory, so the worker cases of the tests run on both.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from typing import Any

from grpo_patches_testing import cpu_torch, skip

TAG_ENV = "NEMO_RL_TAG"


def tag() -> str:
    """The tag line of the NeMo-RL on the path, as the adapter reads it."""
    from grpo_patches import registry

    version = registry.get("nemo_rl").installed_version()
    if version is None:
        skip("not run: no NeMo-RL source on the path (set NEMO_RL_SRC, see compat/sources.py)")
    return {"0.5": "v0.5.0", "0.6": "v0.6.0", "0.7": "v0.7.0", "0.8": "main"}[f"{version.major}.{version.minor}"]


#: The CPU shim of this process (:func:`install_cpu_shim`), undone by :func:`uninstall_cpu_shim`.
CPU_SHIM = cpu_torch.Rebinding()


def install_cpu_shim() -> None:
    """Every ``"cuda"`` placement on the CPU and CUDA queries answered (once per process; undoable)."""
    import torch

    if CPU_SHIM.active:
        return
    cpu_torch.factories_on_cpu(CPU_SHIM, torch)
    cpu_torch.cuda_is_identity(CPU_SHIM, torch)
    cpu_torch.answer_cuda_queries(CPU_SHIM, torch, ("empty_cache", "synchronize", "get_device_name", "current_device",
                                                    "reset_peak_memory_stats", "max_memory_allocated",
                                                    "memory_allocated"))
    cpu_torch.nvtx_noops(CPU_SHIM, torch)  # CPU wheels lack NVTX; v0.5.0's @wrap_with_nvtx_name calls it


def uninstall_cpu_shim() -> None:
    CPU_SHIM.undo()


def stub_megatron() -> None:
    """v0.6.0's ``nemo_rl/distributed/model_utils.py`` imports ``megatron.core`` at the top."""
    if "megatron.core" in sys.modules or importlib.util.find_spec("megatron") is not None:
        return

    def module(name: str, **attrs: Any) -> None:
        mod = types.ModuleType(name)
        mod.__path__ = []
        mod.__dict__.update(attrs)
        sys.modules[name] = mod

    def unavailable(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("megatron is stubbed in this test")

    module("megatron")
    module("megatron.core")
    module("megatron.core.models")
    module("megatron.core.models.gpt", GPTModel=type("GPTModel", (), {}))
    module("megatron.core.parallel_state", get_tensor_model_parallel_group=unavailable,
           get_tensor_model_parallel_rank=unavailable)
    module("megatron.core.utils", deprecate_inference_params=lambda a, b: a, get_pg_size=unavailable)


def init_gloo(rank: int = 0, world: int = 1, port: int | None = None) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(port or 29500 + os.getpid() % 2000)
        dist.init_process_group("gloo", rank=rank, world_size=world)


def setup() -> str:
    """Everything the real code needs on this machine; returns the tag line."""
    name = tag()  # first: without a source this skips, and the main suite's torch stays unshimmed
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("NRL_SKIP_CONTAINER_FINGERPRINT_CHECK", "1")
    install_cpu_shim()
    if name == "v0.6.0":
        stub_megatron()
    return name


def need_worker() -> None:
    """Skip when the worker's own dependency (the pinned Automodel) is not on the path."""
    if importlib.util.find_spec("nemo_automodel") is None:
        skip("not run: no Automodel source on the path (set AUTOMODEL_SRC, see compat/sources.py)")


def tiny_qwen2(tied: bool = False, seed: int = 0) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=23, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied, attention_dropout=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()


def real_worker(tag_name: str, gbs: int, mbs: int, *, dynamic: bool = False, temperature: float | None = None,
                tied: bool = False, fsdp: bool = False, dp: int = 1, dtype: Any = None, norm_scale: float = 1.0) -> Any:
    """The real worker object with a fresh tiny Qwen2 (same seed every time); ``dtype``: its
    parameters and compute dtype (fp32 by default); ``norm_scale``: the final norm's weight
    multiplied by it (large logits)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from grpo_patches_testing.nemo_rl_tags import worker_class

    init_gloo()
    dtype = dtype or torch.float32
    model = tiny_qwen2(tied=tied)
    with torch.no_grad():
        model.model.norm.weight.mul_(norm_scale)
    model = model.to(dtype)
    mesh = init_device_mesh("cpu", (dp, 1, 1), mesh_dim_names=("dp", "cp", "tp"))
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    worker = object.__new__(worker_class(tag_name))
    worker.cfg = {"train_global_batch_size": gbs, "train_micro_batch_size": mbs, "logprob_batch_size": mbs,
                  "dynamic_batching": {"enabled": dynamic}, "sequence_packing": {"enabled": False},
                  "dtensor_cfg": {}, "max_grad_norm": 1.0, "generation": None}
    worker.model = model
    worker.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    worker.scheduler = torch.optim.lr_scheduler.LambdaLR(worker.optimizer, lambda step: 1.0)
    worker.device_mesh = mesh
    worker.dp_mesh, worker.cp_mesh, worker.tp_mesh = mesh["dp"], mesh["cp"], mesh["tp"]
    worker.dp_size, worker.cp_size, worker.tp_size = dp, 1, 1
    worker.moe_mesh = None
    worker.dtype = dtype
    worker.autocast_enabled = False
    worker.allow_flash_attn_args = False
    worker._is_reward_model = False
    worker.enable_seq_packing = False
    worker.sampling_params = None
    worker.max_grad_norm = 1.0e9  # no clipping: compare raw gradients
    worker.tokenizer = None
    worker.rank = 0
    try:
        from nemo_rl.utils.timer import Timer

        worker.timer = Timer()  # main's train() times itself
    except ImportError:
        pass
    if temperature is not None:
        from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams

        worker.sampling_params = TrainingSamplingParams(temperature=temperature)
    return worker
