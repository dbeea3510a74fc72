"""open-instruct's real DeepSpeed learner on a CPU, in-process: ``PolicyTrainerRayProcess.step()``.

:func:`train` builds the plain class behind the Ray actor (``__ray_actor_class__``), runs its own
``from_pretrained`` (DeepSpeed set-up through open-instruct's ``get_train_ds_config`` /
``get_eval_ds_config`` / ``load_ref_policy``) and calls its unmodified ``step()`` on batches packed
and collated by open-instruct's own code (:mod:`.open_instruct_batches`), with a tiny Qwen2 saved
from a config (no hub). :func:`train_ranks` runs it on two gloo ranks (spawned processes).

What a CPU lacks, and the test-only stand-ins (no open-instruct function body is changed, each is
undone when :func:`train` returns):

* ``vllm`` cannot be installed beside torch 2.13: :mod:`.open_instruct_vllm` answers its imports
  while open-instruct's modules are imported (the learner never calls it).
* ``from_pretrained`` is written for one GPU per actor: ``torch.cuda.set_device`` is a no-op, a
  torch function mode sends its ``"cuda"`` placements to the CPU (``MetricsTracker`` on
  ``torch.device(local_rank)``), the model loads without ``device_map``; afterwards the learner's
  ``device`` is the CPU. DeepSpeed runs its CPU accelerator (``DS_ACCELERATOR=cpu``, gloo; a gloo
  group exists before ``from_pretrained``, so its ``nccl`` init is skipped, as upstream intends).
* fp32 (``Config.bf16=False``): ``get_train_ds_config`` / ``get_eval_ds_config`` are called with
  ``bf16=False`` and the model loads in fp32 (upstream hard-codes bf16). ZeRO-3's persistence
  threshold is scaled to the tiny model (``Config.stage3_param_persistence_threshold``).
  ``optimizer="sgd"``: ``torch.optim.AdamW`` built by ``from_pretrained`` becomes SGD (exact
  per-step comparisons; AdamW turns rounding noise into different trajectories), with
  ``zero_allow_untested_optimizer``.
* The data: ``streaming_config.build_dataloader`` (it reaches a Ray actor) returns the batches.

Recorded (:class:`Result`), by hooks on the engines' modules (test-only, nothing changed): the
grad norm DeepSpeed reports after each optimizer step, the final weights (gathered under ZeRO-3),
forwards of the reference model, no-grad forwards of the policy (open-instruct's old-logprob
pre-pass), grad-enabled forwards of the policy (the training forwards), the largest lm-head output
and whether a full ``[B, T, vocab]`` logits tensor was made, ``step()``'s metrics, the lm-head
weight's shard, and (observing ``grpo_utils.resolve_old_logprob``, which is called through) how far
the pre-pass's old log-probs of epoch 0's first accumulation group lie from the training forward's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_patches_testing import cpu_torch, skip

#: The DeepSpeed op open-instruct's set-up builds on first use (a killed build leaves a lock file
#: behind and hangs every later run): built once into the venv, see compat/README.md.
EXTENSIONS = "torch_extensions"


def extensions_dir() -> str:
    """``TORCH_EXTENSIONS_DIR``, else ``torch_extensions/`` in the venv holding deepspeed (a ready
    venv a cell is layered on keeps its op there)."""
    import importlib.util

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    spec = importlib.util.find_spec("deepspeed")
    # deepspeed/__init__.py lies in <venv>/lib/pythonX.Y/site-packages/deepspeed/
    venv = Path(spec.origin).parents[4] if spec and spec.origin else Path(sys.prefix)
    return str(venv / EXTENSIONS)


def environment() -> dict[str, str]:
    """What every process of a run needs before DeepSpeed is imported."""
    return {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": extensions_dir(),
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}


def build_ops() -> Path:
    """Build DeepSpeed's CPU shared-memory comm op (``deepspeed_shm_comm``) into :func:`extensions_dir`
    once: ``deepspeed.init_distributed`` JIT-builds it on first use (minutes on 2 cores), and a build
    that is killed leaves ``lock`` behind, on which every later run waits forever. A lock without a
    built op is such a leftover (run this only while no other build runs): it is removed first."""
    os.environ.update(environment())
    op = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "deepspeed_shm_comm"
    stale = op / "lock"
    if stale.exists() and not (op / "deepspeed_shm_comm.so").exists():
        stale.unlink()
    from deepspeed.accelerator import get_accelerator

    get_accelerator().create_op_builder("ShareMemCommBuilder").load()
    return op


def load() -> Any:
    """open-instruct's ``grpo_fast`` module (imported under the vLLM stand-in); skips without it."""
    import importlib.util

    if importlib.util.find_spec("open_instruct") is None:
        skip("not run: no open-instruct on the path (set OPEN_INSTRUCT_SRC, see compat/README.md)")
    if importlib.util.find_spec("deepspeed") is None:
        skip("not run: no deepspeed in this venv (open-instruct's recipe: compat/README.md)")
    os.environ.update({k: v for k, v in environment().items() if k not in os.environ or k == "DS_ACCELERATOR"})
    from grpo_patches_testing import open_instruct_vllm

    with open_instruct_vllm.installed():
        from open_instruct import grpo_fast  # noqa: PLC0415
    return grpo_fast


def version() -> str:
    """Which open-instruct line is on the path: ``"0.3.0"`` or ``"main"`` (read from its code:
    the package has no version of its own outside a built wheel)."""
    import importlib.util

    spec = importlib.util.find_spec("open_instruct")
    root = Path(spec.origin).parent  # type: ignore[union-attr,arg-type]
    return "main" if (root / "olmo_core_hybrid.py").exists() else "0.3.0"


@dataclass(frozen=True)
class Config:
    """One learner run: open-instruct's options (its names) and the batch's shape."""

    deepspeed_stage: int = 2
    world_size: int = 1
    num_mini_batches: int = 1
    num_epochs: int = 1
    beta: float = 0.0
    load_ref_policy: bool = True
    steps: int = 1
    per_device_train_batch_size: int = 1
    prompts: int = 4
    samples_per_prompt: int = 4
    zero_std_groups: int | tuple[int, ...] = 1  # the first N prompt groups, or these ones, get one score
    filter_zero_std_samples: bool = False
    pack_length: int = 32
    temperature: float = 1.0
    loss_fn: str = "dapo"
    kl_estimator: int = 2
    loss_denominator: str = "token"
    optimizer: str = "sgd"  # or "adamw" (open-instruct's own)
    learning_rate: float = 0.5
    bf16: bool = False
    seed: int = 1
    args: tuple[tuple[str, Any], ...] = ()  # further GRPOExperimentConfig fields
    enable: dict[str, Any] | None = None  # grpo_patches.enable("open_instruct", **enable) around the run
    snapshots: bool = False  # record the weights after every optimizer step
    model_size: tuple[int, int] = (64, 2)  # the tiny Qwen2's hidden size and layers (the shared one: 64, 2)
    #: ZeRO-3 keeps a parameter whole on every rank below this many elements. open-instruct's "auto"
    #: reaches DeepSpeed as its default, 1e5: every tensor of the tiny model would stay whole; at 1000
    #: its matrices (the tied lm-head / embedding included) are partitioned and its norms are not,
    #: as a real model's are at 1e5. ``None``: open-instruct's own setting.
    stage3_param_persistence_threshold: int | None = 1000


@dataclass
class Result:
    grad_norms: list[float] = field(default_factory=list)  # DeepSpeed's, one per optimizer step
    weights: dict[str, Any] = field(default_factory=dict)  # final, full (gathered under ZeRO-3)
    snapshots: list[dict[str, Any]] = field(default_factory=list)  # after each optimizer step
    metrics: list[dict[str, float]] = field(default_factory=list)  # step()'s, per step
    ref_forwards: int = 0
    old_logprob_forwards: int = 0  # no-grad policy forwards: the pre-pass's micro-batches
    policy_forwards: int = 0  # grad-enabled policy forwards
    policy_rows: int = 0  # packed rows through the grad-enabled forwards
    policy_tokens: int = 0  # rows x columns of those forwards
    step_seconds: list[tuple[float, float]] = field(default_factory=list)  # (wall, CPU) seconds of each step()
    micro_batches: list[int] = field(default_factory=list)  # handed to step() on this rank, per step
    micro_batch_shapes: list[list[tuple[int, ...]]] = field(default_factory=list)  # their query_responses, per step
    gradients: list[dict[str, Any]] = field(default_factory=list)  # before each optimizer step (where whole)
    largest_logits: tuple[int, ...] = ()  # the largest lm-head output seen
    full_logits: int = 0  # lm-head outputs of [B, T, vocab]
    ref_model_built: bool = False
    #: the largest |pre-pass old log-prob - training forward's log-prob| over the micro-batches of
    #: epoch 0's first accumulation group (consumed before any optimizer step); None: no pre-pass
    first_group_old_vs_new: float | None = None
    #: the lm-head weight: (its full number of elements, the elements this rank holds); ZeRO-3
    #: holds a 1/world shard outside the lm-head's forward, ZeRO-2 the whole weight
    lm_head_elements: tuple[int, int] = (0, 0)
    #: ``grpo_patches.status()["open_instruct"]`` at the end of a run with ``Config.enable`` (notes, savings)
    status: dict[str, Any] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int = 0, world_size: int = 1, port: int | None = None) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                init_method=f"tcp://127.0.0.1:{port or free_port()}")


def model_path(size: tuple[int, int] = (64, 2)) -> str:
    """The shared tiny Qwen2 (hidden 64, 2 layers, tied embeddings, ~250 words; or ``size``) and its tokenizer."""
    from grpo_patches.demo import tiny_model

    return tiny_model.tiny_model_path(hidden_size=size[0], num_layers=size[1])


def batches(config: Config, path: str, dp_world_size: int) -> list[list[Any]]:
    """Per step, one ``{"batch": CollatedBatchData, "metrics": {}}`` per DP rank."""
    from grpo_patches_testing import open_instruct_batches as ob
    from grpo_patches.demo import tiny_model

    pad = tiny_model.load_tokenizer(path).pad_token_id
    out = []
    for step in range(config.steps):
        r = ob.rollouts(path, prompts=config.prompts, samples_per_prompt=config.samples_per_prompt,
                        zero_std_groups=config.zero_std_groups, seed=config.seed * 1000 + step,
                        temperature=config.temperature)
        per_rank = ob.collated(r, pack_length=config.pack_length, dp_world_size=dp_world_size,
                               per_device_train_batch_size=config.per_device_train_batch_size, pad_token_id=pad,
                               filter_zero_std_samples=config.filter_zero_std_samples, seed=config.seed + step)
        out.append([{"batch": b, "metrics": {}} for b in per_rank])
    return out


def train(config: Config, rank: int = 0) -> Result:
    """Run ``config.steps`` calls of the real ``step()`` on this rank (gloo group set up by the caller
    for two ranks; made here for one)."""
    import torch

    grpo_fast = load()
    from grpo_patches.demo import tiny_model

    init_gloo(rank, config.world_size)
    path = model_path(config.model_size)
    tokenizer = tiny_model.load_tokenizer(path)
    steps = [per_rank[rank] for per_rank in batches(config, path, config.world_size)]
    result = Result(micro_batches=[len(s["batch"]) for s in steps], micro_batch_shapes=shapes(steps))
    cls = grpo_fast.PolicyTrainerRayProcess.__ray_actor_class__
    with _enabled(config.enable):  # before the config is made: grpo_patches acts on it (load_ref_policy at beta 0)
        args, streaming, vllm_config, model_config, beaker = _configs(grpo_fast, config, path, steps)
        learner = cls(config.world_size, rank, rank, "127.0.0.1", free_port(), args, streaming, vllm_config,
                      tokenizer)
        with _cpu_setup(grpo_fast, config):
            learner.from_pretrained(args, model_config, beaker, None, tokenizer)
        learner.device = torch.device("cpu")
        try:
            with _recording(learner, config, result):
                for _ in range(config.steps):
                    wall, cpu = time.perf_counter(), time.process_time()
                    metrics, _arrays = learner.step()
                    result.step_seconds.append((time.perf_counter() - wall, time.process_time() - cpu))
                    result.metrics.append(dict(metrics))
            result.weights = full_weights(learner.model, config.deepspeed_stage)
            result.status = adapter_status(config)
        finally:
            _release(learner)
    return result


def adapter_status(config: Config) -> dict[str, Any]:
    if config.enable is None:
        return {}
    import grpo_patches

    return grpo_patches.status().get("open_instruct", {})


def shapes(steps: list[dict]) -> list[list[tuple[int, ...]]]:
    return [[tuple(t.shape) for t in s["batch"].query_responses] for s in steps]


def full_weights(engine: Any, stage: int) -> dict[str, Any]:
    """Every parameter of the engine's module, full size: the fp32 master copy DeepSpeed's ZeRO
    optimizer holds (a collective under ZeRO-3: every rank calls it). Gathering the module's own
    ZeRO-3 parameters (``GatheredParameters``) after the last step once returned a NaN-filled
    embedding on one of two ranks on a loaded machine; the optimizer's copy is what the next step
    starts from."""
    import torch
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param

    if dist.is_initialized():
        dist.barrier()
    out = {}
    for name, param in engine.module.named_parameters():
        full = safe_get_full_fp32_param(param)
        if full is None:  # not trained (no optimizer copy): the module's own tensor
            import deepspeed

            gather = deepspeed.zero.GatheredParameters([param]) if stage == 3 else contextlib.nullcontext()
            with gather:
                full = param.detach()
        shape = getattr(param, "ds_shape", param.shape)
        out[name] = full.detach().clone().to(torch.float32).reshape(shape)
    return out


def _configs(grpo_fast: Any, config: Config, path: str, steps: list[dict]) -> tuple:
    from open_instruct import data_loader, grpo_utils
    from open_instruct.model_utils import ModelConfig
    from open_instruct.utils import BeakerRuntimeConfig

    args = grpo_utils.GRPOExperimentConfig(
        deepspeed_stage=config.deepspeed_stage, world_size=config.world_size,
        num_learners_per_node=[config.world_size], num_mini_batches=config.num_mini_batches,
        num_epochs=config.num_epochs, beta=config.beta, load_ref_policy=config.load_ref_policy,
        per_device_train_batch_size=config.per_device_train_batch_size, learning_rate=config.learning_rate,
        lr_scheduler_type="constant", warmup_ratio=0.0, fused_optimizer=False, loss_fn=config.loss_fn,
        kl_estimator=config.kl_estimator, loss_denominator=config.loss_denominator, seed=config.seed,
        num_training_steps=config.steps, output_dir=str(Path(path) / "oi-output"), with_tracking=False,
        push_to_hub=False, **dict(config.args))
    streaming = _Streaming(max_prompt_token_length=config.pack_length // 2, response_length=config.pack_length // 2,
                           pack_length=config.pack_length, num_samples_per_prompt_rollout=config.samples_per_prompt,
                           num_unique_prompts_rollout=config.prompts, temperature=config.temperature,
                           filter_zero_std_samples=config.filter_zero_std_samples)
    streaming.batches = steps
    return args, streaming, data_loader.VLLMConfig(), ModelConfig(model_name_or_path=path), \
        BeakerRuntimeConfig(beaker_workload_id="local")


def _streaming_class() -> type:
    from open_instruct.data_loader import StreamingDataLoaderConfig

    class Streaming(StreamingDataLoaderConfig):
        """open-instruct's config whose data loader hands out the prepared batches (the real one
        asks the ``DataPreparationActor`` Ray actor for them)."""

        batches: list[dict] = ()  # type: ignore[assignment]  # set after construction; not a field

        def build_dataloader(self, **kwargs: Any) -> Any:
            return _Batches(list(self.batches))

    return Streaming


class _Batches:
    def __init__(self, items: list[dict]) -> None:
        self.items = items

    def __iter__(self) -> Iterator[dict]:
        return iter(self.items)

    def state_dict(self) -> dict:
        return {}


def _Streaming(**kwargs: Any) -> Any:  # noqa: N802 - a class made on first use (open-instruct imported late)
    return _streaming_class()(**kwargs)


@contextlib.contextmanager
def _enabled(options: dict[str, Any] | None) -> Iterator[None]:
    if options is None:
        yield
        return
    import grpo_patches

    grpo_patches.enable("open_instruct", **options)
    try:
        yield
    finally:
        grpo_patches.disable()


def cpu_stand_ins(config: Config, ds_owner: Any) -> list[tuple[Any, str, Any]]:
    """What ``from_pretrained`` needs on a CPU (module docstring), as ``(owner, attribute, stand-in)``.

    ``ds_owner`` is where the learner looks up open-instruct's DeepSpeed config builders: ``grpo_fast``
    in-process; ``open_instruct.utils`` in the end-to-end run, where Ray ships the learner class by value
    and its globals take the builders from that module by name (each stand-in keeps the builder's name
    for that)."""
    import functools

    import torch
    import transformers

    auto = transformers.AutoModelForCausalLM
    real_load = auto.from_pretrained.__func__

    def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("device_map", None)
        if not config.bf16:
            kwargs["dtype"] = torch.float32
        return real_load(cls, *args, **kwargs)

    def ds_config(real: Any) -> Any:
        @functools.wraps(real)
        def make(*args: Any, **kwargs: Any) -> Any:
            kwargs["bf16"] = config.bf16
            out = real(*args, **kwargs)
            cfg = out[0] if isinstance(out, tuple) else out  # get_eval_ds_config: (config, HfDeepSpeedConfig)
            cfg["zero_allow_untested_optimizer"] = True
            threshold = config.stage3_param_persistence_threshold
            if threshold is not None:
                cfg["zero_optimization"]["stage3_param_persistence_threshold"] = threshold
            return out

        return make

    out = [(torch.cuda, "set_device", lambda *a, **k: None), (auto, "from_pretrained", classmethod(from_pretrained)),
           (ds_owner, "get_train_ds_config", ds_config(ds_owner.get_train_ds_config)),
           (ds_owner, "get_eval_ds_config", ds_config(ds_owner.get_eval_ds_config))]
    if config.optimizer == "sgd":
        out.append((torch.optim, "AdamW", lambda params, lr, **_: torch.optim.SGD(params, lr=lr)))
    return out


@contextlib.contextmanager
def _cpu_setup(grpo_fast: Any, config: Config) -> Iterator[None]:
    """The stand-ins ``from_pretrained`` needs on a CPU (module docstring); all undone on exit."""
    shim = cpu_torch.Rebinding()
    for owner, name, value in cpu_stand_ins(config, grpo_fast):
        shim.set(owner, name, value)
    with shim:
        shim.enter(cpu_torch.cuda_to_cpu_mode())
        yield


def count_forwards(policy: Any, ref: Any, lm_heads: list[Any], vocab: int, result: Result) -> list[Any]:
    """Hooks (removable handles) counting the policy's grad-enabled forwards (training) and no-grad
    forwards (the old-logprob pre-pass), the reference's forwards, and sizing every lm-head output
    (``policy`` or ``ref`` ``None``: not counted)."""
    import torch

    def count_policy(_module: Any, args: Any, kwargs: Any) -> None:
        if torch.is_grad_enabled():
            ids = kwargs.get("input_ids", args[0] if args else None)
            result.policy_forwards += 1
            result.policy_rows += int(ids.shape[0])
            result.policy_tokens += int(ids.numel())
        else:
            result.old_logprob_forwards += 1

    def count_ref(_module: Any, _args: Any, _kwargs: Any) -> None:
        result.ref_forwards += 1

    def logits(_module: Any, _args: Any, output: Any) -> None:
        out = getattr(output, "logits", output)
        shape = tuple(out.shape)
        if not result.largest_logits or out.numel() > _numel(result.largest_logits):
            result.largest_logits = shape
        result.full_logits += int(len(shape) == 3 and shape[-1] == vocab)

    handles = [] if policy is None else [policy.register_forward_pre_hook(count_policy, with_kwargs=True)]
    if ref is not None:
        handles.append(ref.register_forward_pre_hook(count_ref, with_kwargs=True))
    return handles + [head.register_forward_hook(logits) for head in lm_heads]


@contextlib.contextmanager
def _recording(learner: Any, config: Config, result: Result) -> Iterator[None]:
    policy = learner.model.module
    result.ref_model_built = getattr(learner, "ref_policy", None) is not None
    ref = learner.ref_policy.module if result.ref_model_built else None
    heads = [policy.get_output_embeddings()] + ([ref.get_output_embeddings()] if ref is not None else [])
    handles = count_forwards(policy, ref, heads, policy.config.vocab_size, result)
    engine = learner.model
    real_norm, real_step = engine.get_global_grad_norm, engine.step

    def get_global_grad_norm(*a: Any, **k: Any) -> Any:
        norm = real_norm(*a, **k)
        result.grad_norms.append(float(norm))
        return norm

    def step(*a: Any, **k: Any) -> Any:
        out = real_step(*a, **k)
        if config.snapshots:
            result.snapshots.append(full_weights(engine, config.deepspeed_stage))
        return out

    engine.get_global_grad_norm, engine.step = get_global_grad_norm, step
    weight = policy.get_output_embeddings().weight
    result.lm_head_elements = (int(getattr(weight, "ds_numel", weight.numel())),
                               int(weight.ds_tensor.numel() if hasattr(weight, "ds_tensor") else weight.numel()))
    from open_instruct import grpo_utils

    real_resolve = grpo_utils.resolve_old_logprob

    def resolve_old_logprob(cache: list, i: int, epoch: int, num_mini_batches: int, *args: Any) -> Any:
        old = real_resolve(cache, i, epoch, num_mini_batches, *args)  # observed, never changed
        first_group = len(cache) // num_mini_batches  # accumulation_steps (len(cache) is a multiple)
        if num_mini_batches > 1 and epoch == 0 and i < first_group:
            gap = float((old - args[-1].detach()).abs().max())
            result.first_group_old_vs_new = max(result.first_group_old_vs_new or 0.0, gap)
        return old

    grpo_utils.resolve_old_logprob = resolve_old_logprob
    try:
        yield
    finally:
        grpo_utils.resolve_old_logprob = real_resolve
        del engine.get_global_grad_norm, engine.step
        for handle in handles:
            handle.remove()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _release(learner: Any) -> None:
    """Drop the engines, transformers' global ZeRO-3 config and DeepSpeed's ZeRO++ parameter group
    (made once per process by the first ``zero.Init`` with ``deepspeed_zpg`` > 1; a second one
    asserts) before the next run in this process."""
    from deepspeed.utils import groups
    from transformers.integrations import deepspeed as hf_ds

    for name in ("model", "ref_policy", "policy", "optimizer", "scheduler", "ref_policy_hf_ds_config"):
        learner.__dict__.pop(name, None)
    hf_ds.unset_hf_deepspeed_config()
    groups._ZERO_PARAM_INTRA_PARALLEL_GROUP = None
    gc.collect()


# --- two gloo ranks -------------------------------------------------------------------------------

def _rank_main(rank: int, world_size: int, port: int, configs: list[Config], queue: Any) -> None:
    try:
        import torch

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
    import queue as queues
    import time

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


def replace(config: Config, **changes: Any) -> Config:
    return dataclasses.replace(config, **changes)


if __name__ == "__main__":  # python -m grpo_patches_testing.open_instruct_cpu  (the cell's after_install)
    print(f"DeepSpeed CPU comm op: {build_ops()}")
