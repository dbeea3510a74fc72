"""open-instruct's real DeepSpeed learner on a CPU, in-process: ``PolicyTrainerRayProcess.step()``.

:func:`train` builds the plain class behind the Ray actor (``__ray_actor_class__``), runs its own
``from_pretrained`` (DeepSpeed set-up through open-instruct's ``get_train_ds_config`` /
``get_eval_ds_config`` / ``load_ref_policy``) and calls its unmodified ``step()`` on batches packed
and collated by open-instruct's own code (:mod:`.open_instruct_batches`), with a tiny Qwen2 saved
from a config (no hub). :func:`train_ranks` runs it on two gloo ranks (spawned processes).

The pieces, each importable from here as well:

* :mod:`.open_instruct_stand_ins`: what a CPU lacks and the test-only stand-ins (no open-instruct
  function body is changed, each is undone when :func:`train` returns);
* :mod:`.open_instruct_records`: what a run records (:class:`Result`), by hooks on the engines'
  modules;
* :mod:`.open_instruct_ranks`: the gloo group of one rank, or two spawned ranks;
* :mod:`.open_instruct_deepspeed_op`: the environment DeepSpeed needs and its CPU comm op, built
  once into the venv.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_patches_testing import skip
from grpo_patches_testing.open_instruct_deepspeed_op import EXTENSIONS, build_ops, environment, extensions_dir
from grpo_patches_testing.open_instruct_ranks import free_port, init_gloo, train_ranks
from grpo_patches_testing.open_instruct_records import Result, count_forwards, full_weights, recording
from grpo_patches_testing.open_instruct_stand_ins import cpu_setup, cpu_stand_ins, streaming_config

__all__ = ["EXTENSIONS", "Config", "Result", "adapter_status", "batches", "build_ops", "count_forwards",
           "cpu_stand_ins", "environment", "extensions_dir", "free_port", "full_weights", "init_gloo", "load",
           "model_path", "replace", "shapes", "train", "train_ranks", "version"]


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
    #: the policy's lm-head matmul in float64, rounded back to fp32 (unpatched runs only): the same
    #: computation with different rounding, to measure how far fp32 noise alone moves a run
    lm_head_float64: bool = False
    #: the model's parameters and activations in float64 (DeepSpeed still accumulates the gradients and
    #: keeps its master weights in fp32: without fp16/bf16 it takes the model as fp32, ``get_data_types``)
    float64: bool = False
    #: ``"module:function"``: a context manager entered around the run, in the rank's own process (a
    #: planted fault that must reach spawned ranks, where a test's monkeypatch does not)
    around: str | None = None


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
    # enabled before the config is made: grpo_patches acts on it (load_ref_policy at beta 0)
    with _around(config.around), _enabled(config.enable):
        args, streaming, vllm_config, model_config, beaker = _configs(grpo_fast, config, path, steps)
        learner = cls(config.world_size, rank, rank, "127.0.0.1", free_port(), args, streaming, vllm_config,
                      tokenizer)
        with cpu_setup(grpo_fast, config, path):
            learner.from_pretrained(args, model_config, beaker, None, tokenizer)
        learner.device = torch.device("cpu")
        try:
            with recording(learner, config, result):
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
    streaming = streaming_config(
        max_prompt_token_length=config.pack_length // 2, response_length=config.pack_length // 2,
        pack_length=config.pack_length, num_samples_per_prompt_rollout=config.samples_per_prompt,
        num_unique_prompts_rollout=config.prompts, temperature=config.temperature,
        filter_zero_std_samples=config.filter_zero_std_samples)
    streaming.batches = steps
    return args, streaming, data_loader.VLLMConfig(), ModelConfig(model_name_or_path=path), \
        BeakerRuntimeConfig(beaker_workload_id="local")


def _around(name: str | None) -> contextlib.AbstractContextManager:
    if name is None:
        return contextlib.nullcontext()
    import importlib

    module, function = name.split(":")
    return getattr(importlib.import_module(module), function)()


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


def replace(config: Config, **changes: Any) -> Config:
    return dataclasses.replace(config, **changes)

