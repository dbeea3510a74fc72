"""verl's Megatron engine (0.8+) on a CPU: the real ``TrainingWorker`` / ``MegatronEngineWithLMHead``
built through mbridge from the tiny Qwen2 of :mod:`grpo_patches_testing.verl_actor_runs`, run in fp32 on gloo.

Test-only adjustments, none of them to a verl function:

* :mod:`verl_cpu_shim` (verl's CPU platform) and :mod:`megatron_cpu_shim` (megatron-core's CUDA
  placements, RNG tracker, and mbridge's layer spec: the local one, Transformer Engine needs CUDA);
* the engine config's dtype is set to fp32 after verl's validation (verl's Megatron config
  accepts bf16 / fp16 only; exactness is measured in fp32, the gpu tier runs bf16).

Each run records the gradient (Megatron's ``main_grad`` after its DP reduction) before every
optimizer step, the metrics, and the rows through the model with autograd (a forward pre-hook).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from grpo_patches_testing import verl_actor_runs as h
from grpo_patches_testing import verl_engine_runs as engine_runs
from tests.helpers.megatron_tier import GPU, init_nccl

#: fp32 on CPU (exactness at 1e-6); bf16 on the gpu tier (compared with the re-batching noise floor)
DTYPE = "bfloat16" if GPU else "float32"
#: ``GRPO_PATCHES_PLANTED_FAULT=renormalise`` runs every patched update through :func:`renormalising_filter`
#: (the compat cell must then fail: that is how the cells were shown to be able to fail).
PLANTED_FAULT = os.environ.get("GRPO_PATCHES_PLANTED_FAULT")


def renormalising_filter(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """A planted fault: the kept rows only, and verl left to count the loss's tokens over them
    (the naive filter: every kept row's loss renormalised by the kept tokens)."""
    from verl.utils import tensordict_utils as tu

    from grpo_patches.adapters.verl.calls_engine import advantages_and_mask

    data, loss_function, forward_only = args[0], args[1], kwargs.get("forward_only", False)
    adv, mask = advantages_and_mask(data)
    keep = torch.nonzero(((adv != 0) & (mask != 0)).any(-1)).flatten()
    return wrapped(tu.index_select_tensor_dict(data, keep), loss_function, forward_only)


def plant_fault() -> None:
    """Replace the adapter's filtering step with :func:`renormalising_filter` in this process."""
    from grpo_patches.adapters.verl import zero_advantage_engine

    zero_advantage_engine.forward_backward_batch = renormalising_filter


def setup(rank: int = 0, world: int = 1, port: int | None = None) -> None:
    """The CPU platforms and a gloo group (on the gpu tier: verl's own CUDA platform and NCCL)."""
    if PLANTED_FAULT == "renormalise":
        plant_fault()
    from tests.helpers import megatron_cpu_shim

    if not GPU:
        from grpo_patches_testing import verl_cpu_shim

        megatron_cpu_shim.no_cuda_extension_builds()  # before verl's engine modules import megatron.core
        verl_cpu_shim.install()
        megatron_cpu_shim.install()
        megatron_cpu_shim.mbridge_local_layers()
        h.init_pg(rank, world, port)
        return
    megatron_cpu_shim.mbridge_model_type()
    init_nccl(rank, world, port)


def model_dir(root: str, tied: bool = True) -> str:
    """The tiny Qwen2 of :func:`verl_harness.model_dir` with the project's tiny tokenizer beside it
    (verl's Megatron forward reads the tokenizer's pad token id); ``tied=False``: the same weights with an
    lm-head of its own (a copy of the embedding), so Megatron's output layer holds its weight."""
    path = h.model_dir(root) if tied else _untied_model_dir(root)
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        from grpo_patches.demo.tiny_model import build_tokenizer

        build_tokenizer().save_pretrained(path)
    return path


def _untied_model_dir(root: str) -> str:
    path = os.path.join(root, "tiny_qwen2_untied")
    if not os.path.exists(os.path.join(path, "config.json")):
        from transformers import Qwen2ForCausalLM

        tied = h.tiny_model(0)
        config = tied.config
        config.tie_word_embeddings = False
        untied = Qwen2ForCausalLM(config).float()
        state = tied.state_dict()
        state["lm_head.weight"] = tied.get_input_embeddings().weight.detach().clone()
        untied.load_state_dict(state)
        untied.save_pretrained(path)
    return path


def mbridge_output_mapping(path: str) -> None:
    """mbridge's Qwen2 bridge maps the output layer to the embedding in its class-level table once a tied model
    was loaded in the process, and never back: an untied model at ``path`` gets ``lm_head.weight`` again."""
    import json

    from mbridge.models.qwen2 import Qwen2Bridge

    with open(os.path.join(path, "config.json")) as f:
        tied = json.load(f).get("tie_word_embeddings", False)
    if not tied:
        Qwen2Bridge._DIRECT_MAPPING["output_layer.weight"] = "lm_head.weight"


def output_layer(module: Any) -> Any:
    """Megatron's output layer (the ``[tokens, vocab]`` projection) inside a wrapped model chunk."""
    return next(layer for name, layer in module.named_modules() if name.endswith("output_layer"))


def _supported(config_class: type, **fields: Any) -> dict:
    """The fields this verl's config class has (newer options are absent from older verls)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(config_class)}
    return {k: v for k, v in fields.items() if k in names}


def _main_grads(module: list) -> torch.Tensor:
    parts = []
    for chunk in module:
        for p in chunk.parameters():
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad if p.grad is not None else torch.zeros_like(p)
            parts.append(g.detach().double().flatten().cpu())
    return torch.cat(parts)


class MegatronWorker:
    """One ``TrainingWorker`` on verl's Megatron engine, reused across runs (weights reset before each)."""

    def __init__(self, path: str, *, tp: int = 1, pp: int = 1, dynamic: bool = False, mbs: int = 2,
                 max_tokens: int = 40, dtype: str = DTYPE, per_token: bool = False, fused: bool = False):
        from verl.trainer.config import CheckpointConfig
        from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig, TrainingWorkerConfig
        from verl.workers.engine_workers import TrainingWorker

        # fused: verl's fused Megatron forward (packed THD sequences: the shim's block-diagonal attention);
        # its Triton kernel cannot run on a CPU, so only the tiled loss's answer to its call runs there
        model = HFModelConfig(path=path, use_remove_padding=fused, use_fused_kernels=fused,
                              enable_gradient_checkpointing=False)
        # mbridge turns sequence parallelism on with TP > 1; megatron-core's local norms refuse it
        override = {"attention_dropout": 0.0, "hidden_dropout": 0.0, "sequence_parallel": GPU and tp > 1}
        if per_token:
            override["calculate_per_token_loss"] = True
        engine = McoreEngineConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                   use_mbridge=True, vanilla_mbridge=True, use_distributed_optimizer=False,
                                   sequence_parallel=False, use_dynamic_bsz=dynamic, micro_batch_size_per_gpu=mbs,
                                   max_token_len_per_gpu=max_tokens, override_transformer_config=override,
                                   **_supported(McoreEngineConfig, pad_bshd_to_minibatch_max=False))  # 0.9+ only
        object.__setattr__(engine, "dtype", dtype)  # verl's validation accepts bf16 / fp16 only
        optimizer_overrides: dict = {"sgd_momentum": 0.0}  # no optimizer state carried from one run to the next
        if dtype == "float32":  # verl 0.8 always asks megatron-core for a bf16 optimizer
            optimizer_overrides.update(bf16=False, fp16=False, params_dtype=torch.float32)
        # no clipping on CPU: megatron-core's clip asserts CUDA tensors (the gradient is recorded before the step)
        optim = McoreOptimizerConfig(lr=0.05, optimizer="sgd", weight_decay=0.0, clip_grad=1.0 if GPU else 0.0,
                                     total_training_steps=10, lr_decay_style="constant",  # the same lr in every run
                                     override_optimizer_config=optimizer_overrides)
        self.worker = TrainingWorker(TrainingWorkerConfig(model_type="language_model", model_config=model,
                                                          engine_config=engine, optimizer_config=optim,
                                                          checkpoint_config=CheckpointConfig()))
        self.worker.reset()
        self.engine = self.worker.engine
        if per_token:
            _lift_bshd_guard(self.engine)
        self.initial = [{k: v.detach().clone() for k, v in chunk.state_dict().items() if v is not None
                         and isinstance(v, torch.Tensor)} for chunk in self.engine.module]
        self.mbs = mbs
        self.current: h.Run | None = None
        for chunk in self.engine.module:
            chunk.register_forward_pre_hook(self._count, with_kwargs=True)
            for name, layer in chunk.named_modules():
                if name.endswith("output_layer"):  # the [tokens, vocab] projection
                    layer.register_forward_hook(self._count_projection)
        step = self.engine.optimizer_step

        def recording_step() -> Any:
            if self.current is not None:
                self.current.grads.append(_main_grads(self.engine.module))
            return step()

        self.engine.optimizer_step = recording_step

    def _count(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self.current is None:
            return
        ids = kwargs.get("input_ids")
        if ids is None:  # a later pipeline stage: no input ids, the micro-batch still runs
            self.current.forwards += 1
            return
        self.current.forwards += 1
        if torch.is_grad_enabled():
            self.current.grad_rows += int(ids.shape[0])
        else:
            self.current.nograd_rows += int(ids.shape[0])

    def _count_projection(self, module: Any, args: tuple, output: Any) -> None:
        if self.current is not None and torch.is_grad_enabled():
            self.current.projections += 1

    def reset_weights(self) -> None:
        for chunk, state in zip(self.engine.module, self.initial):
            chunk.load_state_dict(state, strict=False)

    def set_loss(self, agg: str = "token-mean", loss_mode: str = "vanilla", **actor_extra: Any) -> None:
        from functools import partial

        from verl.workers.config import McoreActorConfig
        from verl.workers.config.actor import PolicyLossConfig
        from verl.workers.utils.losses import ppo_loss

        actor = McoreActorConfig(strategy="megatron", rollout_n=1, ppo_mini_batch_size=h.ROWS, loss_agg_mode=agg,
                                 policy_loss=PolicyLossConfig(loss_mode=loss_mode), use_torch_compile=False,
                                 ppo_micro_batch_size_per_gpu=self.mbs, **actor_extra)
        self.worker.set_loss_fn(partial(ppo_loss, config=actor))

    def run_td(self, td: Any, options: dict | None | str) -> h.Run:
        """:meth:`verl_harness.EngineWorker.run_td`'s shape (the loss as :meth:`set_loss` makes it by default)."""
        return self.run(options, td=td)

    def run(self, options: dict | None, *, agg: str = "token-mean", n_mini: int = 1, zero: str = "interleaved",
            dp_rank: int = 0, dp: int = 1, batch_extra: dict | None = None, calculate_entropy: bool = False,
            td: Any = None, **actor_extra: Any) -> h.Run:
        """``train_mini_batch`` of this DP rank's rows from the initial weights (``options=None``: unpatched)."""
        from verl.utils import tensordict_utils as tu

        if td is None:
            td = engine_runs.engine_batch(dp_rank, dp, mini_rows=h.ROWS // n_mini, zero=zero, extra=batch_extra,
                                calculate_entropy=calculate_entropy)
        self.reset_weights()
        self.set_loss(agg=agg, **actor_extra)
        if options != "as is":
            h.patches(options)
        self.current = run = h.Run()
        run.projections = 0  # the output layer's [tokens, vocab] projections with autograd
        try:
            out = self.worker.train_mini_batch(td)
            run.status = h.verl_status()
        finally:
            self.current = None
            if options != "as is":
                h.patches(None)
        run.metrics = tu.get(out, "metrics") if out is not None else {}
        return run


def _lift_bshd_guard(engine: Any) -> None:
    """verl refuses ``calculate_per_token_loss`` without ``use_remove_padding`` (the THD layout, which needs
    Transformer Engine's attention) because its MoE router would count padding; the tiny model is dense
    and has no router, so the test reads the flag as set while the per-token loss is computed."""
    method = engine.postprocess_micro_batch_func

    def postprocess(*args: Any, **kwargs: Any) -> Any:
        engine.engine_config.use_remove_padding = True
        try:
            return method(*args, **kwargs)
        finally:
            engine.engine_config.use_remove_padding = False

    engine.postprocess_micro_batch_func = postprocess
