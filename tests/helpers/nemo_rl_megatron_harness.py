"""NeMo-RL's real Megatron policy worker on a CPU, in one process (tests only; nothing here ships).

``MegatronPolicyWorkerImpl.train`` and ``get_logprobs`` run unchanged on a tiny megatron-core
``GPTModel`` (local layers, gloo, one rank). What it takes:

* **Importing the worker.** Megatron-Bridge's ``megatron.bridge.peft.lora_layers`` (reached from
  ``megatron.bridge/__init__``) runs ``import transformer_engine.pytorch as te`` at module level and
  only uses ``te`` inside methods. :class:`_BridgeTEFinder` gives exactly that module (and the TE
  layer spec module) a stand-in ``transformer_engine`` while its body executes, after importing
  every module it imports, and removes it again: megatron-core's ``HAVE_TE`` probes never see it
  (a stand-in left in ``sys.modules`` makes megatron-core take TE for installed, see compat/README.md).
  :func:`setup` checks that no loaded ``megatron.core`` module says ``HAVE_TE = True``.
* **megatron-core on a CPU**: :mod:`tests.helpers.megatron_cpu_shim` (as the verl Megatron cells).
* **The worker without its ``__init__``** (which needs GPUs, Ray and a HF checkpoint converted by
  Megatron-Bridge): :func:`real_worker` builds the pieces ``train`` / ``get_logprobs`` read, as
  :func:`grpo_patches_testing.nemo_rl_cpu.real_worker` does for the DTensor worker: the model
  wrapped in megatron-core's ``DistributedDataParallel``, megatron-core's optimizer (SGD, no
  clipping) and LR scheduler, a straggler timer, and the worker's flags at their defaults.

On the gpu tier (:mod:`tests.helpers.megatron_tier`) the same worker runs on CUDA in bf16 (NCCL,
megatron-core's ``Float16Module`` and mixed-precision optimizer as Megatron-Bridge builds them, Transformer
Engine layers where TE is installed, and then no stand-in: the real TE is imported); ``bf16=True`` builds
that precision on a CPU too (local layers), so the bf16 path is exercised without a GPU.

Measured on NeMo-RL v0.7.0, Python 3.12, megatron-core 0.19.2, Megatron-Bridge 0.6.2 (PyPI,
``--no-deps``; the import also needs ``nvidia-modelopt``, ``megatron-energon``, ``tensorboard``
and NeMo-RL's logger packages: compat/README.md has the recipe); v0.6.0 and main on the
megatron-core / Megatron-Bridge pair each pins (built from checkouts: compat/README.md).
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.util
import os
import sys
import types
from typing import Any

from grpo_patches_testing import skip
from tests.helpers import megatron_tier

#: Megatron-Bridge modules that import Transformer Engine at module level (Megatron-Bridge 0.6.2; ``peft.lora``:
#: 0.5.0, NeMo-RL v0.6.0's pin).
BRIDGE_TE_MODULES = ("megatron.bridge.peft.lora_layers", "megatron.bridge.models.gpt_full_te_layer_autocast_spec",
                     "megatron.bridge.peft.lora")
WORKER_MODULE = "nemo_rl.models.policy.workers.megatron_policy_worker"
VOCAB = 23


class _Absent:
    """A Transformer Engine class of the stand-in: it can be named and subclassed, never built."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Transformer Engine stand-in (CPU tests): only its names exist")


class _StandInModule(types.ModuleType):
    """Any attribute is a fresh :class:`_Absent` subclass (``te.Linear``, ``te.ops.Sequential``, ...)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = type(name, (_Absent,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


def _stand_in() -> dict[str, types.ModuleType]:
    modules = {name: _StandInModule(name) for name in
               ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.ops")}
    for name, module in modules.items():
        module.__path__ = []  # a package: submodules import from it
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(modules[parent], child, module)
    return modules


def _imported_names(path: str) -> list[str]:
    """The absolute module names a source file imports at its top level."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    names: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return [name for name in names if name.split(".")[0] != "transformer_engine"]


class _StandInLoader(importlib.abc.Loader):
    """Executes one module with the stand-in in ``sys.modules``, and nothing else."""

    def __init__(self, inner: importlib.abc.Loader, origin: str) -> None:
        self.inner, self.origin = inner, origin

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        for name in _imported_names(self.origin):  # first, so none of them runs beside the stand-in
            importlib.import_module(name)
        stand_in = _stand_in()
        if any(name in sys.modules for name in stand_in):
            raise RuntimeError("transformer_engine is already imported: the stand-in would shadow it")
        sys.modules.update(stand_in)
        try:
            self.inner.exec_module(module)
        finally:
            for name in stand_in:
                sys.modules.pop(name, None)


class _BridgeTEFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in BRIDGE_TE_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                spec.loader = _StandInLoader(spec.loader, spec.origin)
                return spec
        return None


def install_bridge_te_stand_in() -> None:
    """Idempotent; before Megatron-Bridge is first imported."""
    if not any(isinstance(finder, _BridgeTEFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _BridgeTEFinder())


def modules_that_see_te() -> list[str]:
    """Loaded megatron-core modules whose ``HAVE_TE`` says Transformer Engine is installed, and the
    stand-in if it stayed in ``sys.modules``. (Some Megatron-Bridge modules set ``HAVE_TE`` from the
    names ``megatron.core.extensions.transformer_engine`` defines with or without TE: True on any
    machine without TE, and only read by its LoRA / Gemma 4 code.)"""
    seen = sorted(name for name, module in list(sys.modules.items())
                  if name.startswith("megatron.core") and getattr(module, "HAVE_TE", False) is True)
    return seen + [name for name in sys.modules if name.split(".")[0] == "transformer_engine"]


def stand_in_names() -> list[str]:
    """Loaded Megatron-Bridge modules holding a name of the stand-in (expected on a CPU; with the real TE: none)."""
    return sorted(name for name in BRIDGE_TE_MODULES if name in sys.modules and any(
        isinstance(v, _StandInModule) or (isinstance(v, type) and issubclass(v, _Absent))
        for v in vars(sys.modules[name]).values()))


def setup(rank: int = 0, world: int = 1, port: int | None = None, tp: int = 1, pp: int = 1) -> Any:
    """Shims, a gloo group (of one; ``world`` ranks: ``tp`` x ``pp`` model parallel, the rest data
    parallel), megatron-core's parallel state; returns the worker module. Skips (under pytest) without
    a NeMo-RL source or Megatron-Bridge on the path.
    On the gpu tier: no shims, an NCCL group, and the real Transformer Engine where it is installed."""
    from grpo_patches_testing.nemo_rl_cpu import init_gloo, tag

    name = tag()
    if name == "v0.5.0":  # v0.6.0+ measured (compat/README.md, NeMo-RL's Megatron worker)
        skip("not run: NeMo-RL v0.5.0's Megatron worker was not run")
    if importlib.util.find_spec("megatron.bridge") is None:
        skip("not run: no Megatron-Bridge on the path (compat/README.md, NeMo-RL's Megatron worker)")
    os.environ.setdefault("NRL_SKIP_CONTAINER_FINGERPRINT_CHECK", "1")
    real_te = megatron_tier.use_te()
    if not real_te:  # the stand-in would hide an installed Transformer Engine from Megatron-Bridge
        install_bridge_te_stand_in()
    if megatron_tier.GPU:
        megatron_tier.init_nccl(rank, world, port)
    else:
        from tests.helpers import megatron_cpu_shim

        megatron_cpu_shim.install()  # before megatron-core builds or allocates anything
        init_gloo(rank, world, port)
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, pp)
    worker_module = importlib.import_module(WORKER_MODULE)
    if real_te and stand_in_names():
        raise RuntimeError(f"the Transformer Engine stand-in hides the installed one in {stand_in_names()}")
    seen = [] if real_te else modules_that_see_te()
    if seen:
        raise RuntimeError(f"megatron-core takes Transformer Engine for installed in {seen}")
    return worker_module


def tiny_gpt(seed: int = 0, bf16: bool = megatron_tier.BF16) -> Any:
    """A 2-layer megatron-core ``GPTModel`` (no dropout, same weights per seed): local layers, fp32 on the cpu tier;
    this rank's tensor / pipeline part of it under the parallel state :func:`setup` made.
    ``bf16`` (the gpu tier's default): bf16 weights in megatron-core's ``Float16Module`` (fp32 logits), as
    Megatron-Bridge builds a bf16 policy; on the gpu tier on CUDA, with TE layers where TE is installed."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if bf16 else torch.float32
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=64, params_dtype=dtype, bf16=bf16, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
                               masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
                               gradient_accumulation_fusion=False,
                               tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
                               pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
                               pipeline_dtype=dtype)
    torch.manual_seed(seed)
    if megatron_tier.GPU:  # megatron-core's CUDA RNG tracker, reset to the seed (as Megatron-Bridge seeds it)
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    tp = config.tensor_model_parallel_size
    vocab = -(-VOCAB // tp) * tp  # split over TP ranks: padded to a multiple of TP, as Megatron-Bridge pads it
    gpt = GPTModel(config, _layer_spec(config), vocab_size=vocab, max_sequence_length=64,
                   position_embedding_type="rope", pre_process=parallel_state.is_pipeline_first_stage(),
                   post_process=parallel_state.is_pipeline_last_stage())
    if megatron_tier.GPU:
        gpt = gpt.cuda()
    if not bf16:
        return gpt
    from megatron.core.transformer.module import Float16Module

    return Float16Module(config, gpt)


def _layer_spec(config: Any) -> Any:
    """Transformer Engine layers on the gpu tier where TE is installed, megatron-core's local ones otherwise."""
    if not megatron_tier.use_te():
        from tests.helpers.megatron_cpu_shim import local_layer_spec

        return local_layer_spec(config)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(config, use_transformer_engine=True)


def real_worker(gbs: int, mbs: int, *, seed: int = 0, lr: float = 0.1, dp: int = 1,
                bf16: bool = megatron_tier.BF16) -> Any:
    """The real ``MegatronPolicyWorkerImpl`` object with a fresh tiny GPT (same seed, same weights);
    ``dp``: the data-parallel size :func:`setup` made (its ``tp`` / ``pp`` are read from the parallel state);
    ``bf16``: :func:`tiny_gpt`'s."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.utils import StragglerDetector

    worker_module = setup()
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    gpt = tiny_gpt(seed, bf16)
    model = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(use_distributed_optimizer=False), gpt)
    if dp > 1 or pp > 1:  # the schedule's gradient all-reduce over DP and of the tied embedding over PP
        # (Megatron-Bridge's setup sets it in NeMo-RL)
        from megatron.core.distributed import finalize_model_grads

        gpt.config.finalize_model_grads_func = finalize_model_grads
    # megatron-core's mixed-precision optimizer (fp32 main weights) takes CUDA tensors only: bf16 on a CPU steps
    # the bf16 weights themselves (the gradient is recorded before each step)
    optimizer_config = OptimizerConfig(optimizer="sgd", lr=lr, clip_grad=0.0, params_dtype=torch.float32,
                                       bf16=bf16 and megatron_tier.GPU)
    optimizer = get_megatron_optimizer(optimizer_config, [model])
    scheduler = OptimizerParamScheduler(optimizer, init_lr=lr, max_lr=lr, min_lr=lr, lr_warmup_steps=0,
                                        lr_decay_steps=1, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=1, wd_incr_style="constant")
    worker = object.__new__(worker_module.MegatronPolicyWorkerImpl)
    worker.cfg = {"train_global_batch_size": gbs, "train_micro_batch_size": mbs, "logprob_batch_size": mbs,
                  "dynamic_batching": {"enabled": False}, "sequence_packing": {"enabled": False},
                  "make_sequence_length_divisible_by": 1, "max_grad_norm": 0.0, "generation": None,
                  "megatron_cfg": {"empty_unused_memory_level": 0, "tensor_model_parallel_size": tp,
                                   "pipeline_model_parallel_size": pp, "context_parallel_size": 1,
                                   "sequence_parallel": False, "moe_per_layer_logging": False}}
    worker.model, worker.optimizer, worker.scheduler = model, optimizer, scheduler
    worker.megatron_cfg = types.SimpleNamespace(optimizer=optimizer_config)  # Megatron-Bridge's ConfigContainer
    worker.mcore_state = types.SimpleNamespace(straggler_timer=StragglerDetector())  # Megatron-Bridge's GlobalState
    worker.dp_size = dp
    worker.dtype = torch.bfloat16 if bf16 else torch.float32
    worker.fp8_cfg = None
    worker.sampling_params = None
    worker.draft_model = None
    worker.delegate_pack_to_model = False
    worker.defer_fp32_logits = False
    worker.should_disable_forward_pre_hook = False
    worker._first_train_step_forward_pre_hook_disabled = False
    worker._first_train_step_param_sync_func = None
    worker._router_replay_enabled = False
    worker.rank = 0
    if hasattr(worker_module, "Timer"):  # main's __init__ also sets these (read by train / get_logprobs)
        worker.timer = worker_module.Timer(context={"worker": "megatron_policy", "rank": 0})
        worker.media_placeholder_token_id = None
        worker.delegate_mtp_loss_mask_to_model = False
        worker.model_slices_context_parallel_inputs = False
    return worker


def record_grads(worker: Any) -> list:
    """The list that gets :func:`main_grads` of ``worker``'s model before each of its optimizer steps."""
    grads: list = []
    step = worker.optimizer.step

    def recording_step(*args: Any, **kwargs: Any) -> Any:
        grads.append(main_grads(worker.model))
        return step(*args, **kwargs)

    worker.optimizer.step = recording_step
    return grads


def main_grads(model: Any) -> Any:
    """The gradient megatron-core's DDP accumulated (``main_grad``), flattened in parameter order."""
    import torch

    return torch.cat([p.main_grad.detach().reshape(-1).double() for p in model.parameters()])


def direct_logprobs(gpt: Any, input_ids: Any) -> Any:
    """``[rows, seq - 1]`` next-token log-probs of one plain forward (no NeMo-RL, causal mask built
    by megatron-core): the reference the worker's micro-batched path is compared with."""
    import torch

    input_ids = input_ids.to(next(gpt.parameters()).device)  # the gpu tier's model is on CUDA
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
    logits = gpt(input_ids=input_ids, position_ids=positions, attention_mask=None).float()
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1)
    return logprobs.gather(-1, input_ids[:, 1:, None]).squeeze(-1).cpu()
