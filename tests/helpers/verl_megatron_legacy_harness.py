"""verl's legacy Megatron worker (0.6.1-0.7.x) on a CPU: the real ``ActorRolloutRefWorker`` of
``verl.workers.megatron_workers`` (role ``"actor"``), built by its own ``init_model`` through mbridge
from the tiny Qwen2 of :mod:`grpo_patches_testing.verl_actor_runs`, updated by its own ``update_actor`` (fp32, gloo).

Test-only adjustments, none of them to a verl function body:

* :mod:`verl_cpu_shim`, :mod:`megatron_cpu_shim` (as for the engine line: :mod:`verl_megatron_harness`);
  the worker finds ``torch.distributed`` and megatron's parallel state set up by the test;
* verl's Megatron config accepts bf16 / fp16 only: ``McoreEngineConfig``'s validation runs with
  ``bfloat16`` and the fp32 the worker built the model in is put back after it;
* fp32 on CPU; bf16 on the gpu tier (``GRPO_PATCHES_TIER=gpu``: NCCL, Transformer Engine layers);
* BSHD (``use_remove_padding=False``: the THD layout needs Transformer Engine's attention; verl 0.6.1
  packs THD always, which the shim's local attention takes), dropout 0,
  SGD without momentum or clipping (megatron-core's clip asserts CUDA tensors; the gradient is
  recorded before the step).

Each run records Megatron's ``main_grad`` (after its DP reduction) before every optimizer step, the
worker's metrics, and the rows through the model with autograd (a forward pre-hook).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from grpo_patches_testing import verl_actor_runs as h
from tests.helpers import verl_megatron_harness as mh


def renormalising_filter(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """A planted fault: the kept rows only, and verl left to split and average them (the naive filter:
    every kept row's loss renormalised by the kept rows' micro-batches and tokens)."""
    data = args[0]
    if kwargs.get("forward_only") or "advantages" not in data.batch.keys():
        return wrapped(*args, **kwargs)
    adv, mask = data.batch["advantages"], data.batch["response_mask"]
    keep = torch.nonzero(((adv != 0) & (mask != 0)).any(-1)).flatten()
    return wrapped(data.select_idxs(keep), *args[1:], **kwargs)


def plant_fault() -> None:
    """Replace the adapter's legacy Megatron filter with :func:`renormalising_filter` in this process."""
    from grpo_patches.adapters.verl import zero_advantage_megatron_legacy

    zero_advantage_megatron_legacy.forward_backward_batch = renormalising_filter


def setup(rank: int = 0, world: int = 1, port: int | None = None, *, tp: int = 1, pp: int = 1) -> None:
    """The CPU shims, a gloo group and megatron's parallel state (the worker initialises none when they exist).
    ``GRPO_PATCHES_PLANTED_FAULT=renormalise`` plants :func:`renormalising_filter` (the cell must then fail)."""
    mh.setup(rank, world, port)
    if mh.PLANTED_FAULT == "renormalise":
        plant_fault()
    from megatron.core import parallel_state as mpu

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    _fp32_engine_config()


def _fp32_engine_config() -> None:
    from verl.workers.config.engine import McoreEngineConfig

    validate = McoreEngineConfig.__post_init__
    if getattr(validate, "_grpo_patches_fp32", False):
        return

    def post_init(self: Any) -> None:
        fp32 = self.dtype == "float32"
        if fp32:
            object.__setattr__(self, "dtype", "bfloat16")
        validate(self)
        if fp32:
            object.__setattr__(self, "dtype", "float32")

    post_init._grpo_patches_fp32 = True  # type: ignore[attr-defined]
    McoreEngineConfig.__post_init__ = post_init


def worker_config(path: str, *, tp: int, pp: int, dp: int, mbs: int, max_tokens: int, per_token: bool,
                  fused: bool = False) -> Any:
    """verl's own Megatron trainer config (``_generated_ppo_megatron_trainer.yaml``), ``actor_rollout_ref``.
    ``fused``: verl's fused Megatron forward (packed THD sequences: the shim's block-diagonal attention);
    its Triton kernel cannot run on a CPU, so only the tiled loss's answer to its call runs there."""
    from omegaconf import OmegaConf
    import verl.trainer.config as verl_config

    config = OmegaConf.load(os.path.join(os.path.dirname(verl_config.__file__), "_generated_ppo_megatron_trainer.yaml"))
    arr = config.actor_rollout_ref
    arr.model.path = path
    arr.model.use_fused_kernels = fused
    arr.rollout.n = 1
    arr.rollout.log_prob_micro_batch_size_per_gpu, arr.rollout.log_prob_max_token_len_per_gpu = 4, max_tokens
    actor = arr.actor
    actor.ppo_mini_batch_size = h.ROWS * dp  # verl divides it by the data-parallel size
    actor.ppo_micro_batch_size_per_gpu = mbs
    actor.ppo_max_token_len_per_gpu = max_tokens
    actor.use_kl_loss, actor.entropy_coeff = False, 0.0
    override = {"attention_dropout": 0.0, "hidden_dropout": 0.0, "sequence_parallel": False}
    if per_token:
        override["calculate_per_token_loss"] = True
    from verl.workers.config.engine import McoreEngineConfig

    # vanilla_mbridge (0.7: mbridge rather than Megatron-Bridge) is absent from 0.6.1, which has mbridge only
    actor.megatron.update(mh._supported(McoreEngineConfig, tensor_model_parallel_size=tp,
                                        pipeline_model_parallel_size=pp, use_mbridge=True, vanilla_mbridge=True,
                                        dtype=mh.DTYPE, use_remove_padding=False, sequence_parallel=False,
                                        use_distributed_optimizer=False, override_transformer_config=override))
    # no optimizer state carried from one run to the next; verl 0.6.1 asks for megatron-core's distributed
    # optimizer whatever megatron.use_distributed_optimizer says (that one refuses SGD)
    optimizer = {"sgd_momentum": 0.0, "use_distributed_optimizer": False}
    if mh.DTYPE == "float32":
        optimizer.update(bf16=False, fp16=False)
    actor.optim.update(optimizer="sgd", lr=0.05, clip_grad=0.0, weight_decay=0.0, total_training_steps=10,
                       lr_decay_style="constant", override_optimizer_config=optimizer)
    return arr


class LegacyMegatronWorker:
    """One ``ActorRolloutRefWorker(role="actor")``, reused across runs (weights reset before each)."""

    def __init__(self, path: str, *, tp: int = 1, pp: int = 1, dp: int = 1, mbs: int = 2, max_tokens: int = 40,
                 per_token: bool = False, fused: bool = False):
        from verl.workers.megatron_workers import ActorRolloutRefWorker

        mh.mbridge_output_mapping(path)
        self.worker = ActorRolloutRefWorker(worker_config(path, tp=tp, pp=pp, dp=dp, mbs=mbs, max_tokens=max_tokens,
                                                          per_token=per_token, fused=fused), role="actor")
        self.worker.init_model()
        self.actor = self.worker.actor
        self.modules = list(self.actor.actor_module)
        self.initial = [{k: v.detach().clone() for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}
                        for m in self.modules]
        self.base = {f: getattr(self.actor.config, f) for f in ("loss_agg_mode", "use_dynamic_bsz",
                                                                 "ppo_mini_batch_size", "ppo_epochs", "use_kl_loss",
                                                                 "kl_loss_coef", "entropy_coeff")}
        self.current: h.Run | None = None
        for module in self.modules:
            module.register_forward_pre_hook(self._count, with_kwargs=True)
            for name, layer in module.named_modules():
                if name.endswith("output_layer"):  # the [tokens, vocab] projection
                    layer.register_forward_hook(self._count_projection)
        optimizer = self.actor.actor_optimizer
        step = optimizer.step

        def recording_step() -> Any:
            if self.current is not None:
                self.current.grads.append(mh._main_grads(self.modules))
            return step()

        optimizer.step = recording_step

    def _count(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self.current is None:
            return
        self.current.forwards += 1
        ids, packed = kwargs.get("input_ids"), kwargs.get("packed_seq_params")
        if ids is not None and torch.is_grad_enabled():  # later pipeline stages get no input ids
            # verl 0.6.1 packs a micro-batch's rows into one THD sequence: count the packed rows
            self.current.grad_rows += int(ids.shape[0]) if packed is None else len(packed.cu_seqlens_q) - 1

    def _count_projection(self, module: Any, args: tuple, output: Any) -> None:
        if self.current is not None and torch.is_grad_enabled():
            self.current.projections += 1

    def configure(self, **fields: Any) -> None:
        """Set actor config fields for the next run (verl's config objects are frozen dataclasses)."""
        for name, value in {**self.base, **fields}.items():
            object.__setattr__(self.actor.config, name, value)

    def data(self, *, dp_rank: int = 0, dp: int = 1, zero: str = "interleaved", extra: dict | None = None) -> Any:
        from verl import DataProto

        batch = h.rank_rows(h.make_batch(world=dp, zero_rows=h.ZERO_ROWS[zero]), dp_rank)
        batch.update(extra or {})
        tokens = batch["attention_mask"].sum(-1).tolist()
        return DataProto.from_dict(tensors=batch, meta_info={"temperature": 1.0, "global_token_num": tokens})

    def run(self, options: dict | None, *, agg: str = "token-mean", dynamic: bool = False, n_mini: int = 1,
            zero: str = "interleaved", dp_rank: int = 0, dp: int = 1, batch_extra: dict | None = None,
            data: Any = None, **actor_fields: Any) -> h.Run:
        """``update_actor`` of this DP rank's rows from the initial weights (``options=None``: unpatched)."""
        for module, state in zip(self.modules, self.initial):
            module.load_state_dict(state, strict=False)
        self.configure(loss_agg_mode=agg, use_dynamic_bsz=dynamic, ppo_mini_batch_size=h.ROWS // n_mini,
                       **actor_fields)
        if data is None:
            data = self.data(dp_rank=dp_rank, dp=dp, zero=zero, extra=batch_extra)
        if options != "as is":
            h.patches(options)
        self.current = run = h.Run()
        run.projections = 0  # the output layer's [tokens, vocab] projections with autograd
        try:
            out = self.worker.update_actor(data)
            run.status = h.verl_status()
        finally:
            self.current = None
            if options != "as is":
                h.patches(None)
        run.metrics = out.meta_info["metrics"]
        return run


class WorkerGroup:
    """Stands in for the trainer's actor worker group: the real worker's methods, in this process."""

    world_size = 1

    def __init__(self, worker: LegacyMegatronWorker):
        self.worker, self.calls = worker, 0

    def compute_log_prob(self, data: Any) -> Any:
        self.calls += 1
        return self.worker.worker.compute_log_prob(data)

    def update_actor(self, data: Any) -> Any:
        return self.worker.worker.update_actor(data)


def old_pass_then_update(worker: LegacyMegatronWorker, options: dict | None) -> h.Run:
    """The legacy trainer's real ``_compute_old_log_prob`` and ``_update_actor`` on the Megatron worker."""
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    for module, state in zip(worker.modules, worker.initial):
        module.load_state_dict(state, strict=False)
    worker.configure()
    trainer = object.__new__(RayPPOTrainer)
    trainer.config = OmegaConf.merge(h.trainer_config(use_kl_loss=False, mini=h.ROWS),
                                     {"actor_rollout_ref": {"rollout": {"multi_turn": {"enable": False}}}})
    trainer.use_legacy_worker_impl = "auto"
    trainer.actor_rollout_wg = group = WorkerGroup(worker)
    batch = h.make_batch()
    batch.pop("old_log_probs")
    data = DataProto.from_dict(tensors=batch, meta_info={"temperature": 1.0,
                                                         "global_token_num": batch["attention_mask"].sum(-1).tolist()})
    h.patches(options)
    worker.current = run = h.Run()
    run.projections = 0
    try:
        old, _ = trainer._compute_old_log_prob(data)
        old.batch.pop("entropys", None)
        out = trainer._update_actor(data.union(old))
        run.status = h.verl_status()
    finally:
        worker.current = None
        h.patches(None)
    run.metrics = out.meta_info["metrics"]
    run.forwards = group.calls
    return run
