"""verl's engine line (0.8.0-0.9.1) on a CPU: ``TrainingWorker.train_mini_batch`` (FSDP2 engine,
``ppo_loss``) with the CPU platform of :mod:`verl_cpu_shim`, fed the tensordict the v0 trainer
builds, on the model and batches of :mod:`verl_actor_runs`; and the v0 trainer's old-logprob pass
(on the engine worker or the 0.7.x legacy actor) followed by the update.
"""

from __future__ import annotations

import torch

from grpo_patches_testing.verl_actor_runs import (ROWS, ZERO_ROWS, Run, fused_types, grads_of, init_pg, line,
                                                  make_batch, model_dir, patches, rank_rows, trainer_config,
                                                  verl_status)
from grpo_patches_testing.verl_minimal_pass import legacy_group


def engine_setup(rank: int = 0, world: int = 1, port: int | None = None) -> None:
    from grpo_patches_testing import verl_cpu_shim

    verl_cpu_shim.install()  # before anything asks verl for its platform
    init_pg(rank, world, port)


def setup_process() -> None:
    """The gloo group (legacy) or the engine's setup (CPU platform + gloo group), once per process."""
    torch.set_num_threads(2)
    if line().startswith("legacy"):
        init_pg()
    else:
        engine_setup()


class EngineWorker:
    """One FSDP2 ``TrainingWorker`` reused across runs (its weights reset before each)."""

    def __init__(self, path: str, *, dynamic: bool = False, mbs: int = 2, max_tokens: int = 40, fused: bool = False,
                 remove_padding: bool = False, dropout: float = 0.0, dtype: str = "fp32",
                 compute_dtype: str | None = None):
        """``dtype``: the weights' (and, unless ``compute_dtype`` says otherwise, FSDP2's compute)
        dtype; ``compute_dtype="bf16"`` with ``dtype="fp32"`` is verl's default mixed precision."""
        from verl.trainer.config import CheckpointConfig
        from verl.workers.config import (FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig,
                                         TrainingWorkerConfig)
        from verl.workers.engine_workers import TrainingWorker

        if fused:
            fused_types()  # the saved model's type, before verl reads its config
        model = HFModelConfig(path=path, load_tokenizer=False, use_remove_padding=remove_padding,
                              enable_gradient_checkpointing=False,
                              override_config={"attn_implementation": "eager", "attention_dropout": dropout},
                              use_fused_kernels=fused, fused_kernel_options={"impl_backend": "torch"} if fused else {})
        engine = FSDPEngineConfig(strategy="fsdp2", model_dtype=dtype, use_torch_compile=False,
                                  mixed_precision={"param_dtype": compute_dtype or dtype, "reduce_dtype": dtype,
                                                   "buffer_dtype": dtype},
                                  use_dynamic_bsz=dynamic, micro_batch_size_per_gpu=mbs, max_token_len_per_gpu=max_tokens)
        optim = FSDPOptimizerConfig(lr=0.05, optimizer="SGD", weight_decay=0.0, clip_grad=1.0)
        self.worker = TrainingWorker(TrainingWorkerConfig(model_type="language_model", model_config=model,
                                                          engine_config=engine, optimizer_config=optim,
                                                          checkpoint_config=CheckpointConfig()))
        self.worker.reset()
        self.engine = self.worker.engine
        self.initial = {k: v.detach().clone() for k, v in self.engine.module.state_dict().items()}
        self.mbs = mbs
        self.current: Run | None = None
        count = Run()
        self._counter = count
        self.engine.module.register_forward_pre_hook(self._count, with_kwargs=True)
        step = self.engine.optimizer_step

        def recording_step():
            if self.current is not None:
                self.current.grads.append(grads_of(self.engine.module.parameters()))
            return step()

        self.engine.optimizer_step = recording_step

    def _count(self, module, args, kwargs):
        if self.current is None:
            return
        ids = kwargs["input_ids"]
        rows = int(ids.size(0))
        self.current.forwards += 1
        if torch.is_grad_enabled():
            self.current.grad_rows += rows
        else:
            self.current.nograd_rows += rows

    def run(self, options: dict | None, *, agg="token-mean", n_mini=1, epochs=1, zero="interleaved", rank=0,
            world=1, loss_mode="vanilla", batch_extra: dict | None = None, calculate_entropy: bool = False,
            **actor_extra) -> Run:
        td = engine_batch(rank, world, mini_rows=ROWS // n_mini, epochs=epochs, zero=zero, extra=batch_extra,
                          calculate_entropy=calculate_entropy)
        return self.run_td(td, options, agg=agg, loss_mode=loss_mode, **actor_extra)

    def set_loss(self, agg="token-mean", loss_mode="vanilla", **actor_extra) -> None:
        """``ppo_loss`` with an actor config, as ``ActorRolloutRefWorker.init_model`` sets it."""
        from functools import partial

        from verl.workers.config import FSDPActorConfig
        from verl.workers.config.actor import PolicyLossConfig
        from verl.workers.utils.losses import ppo_loss

        actor = FSDPActorConfig(strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=ROWS, loss_agg_mode=agg,
                                policy_loss=PolicyLossConfig(loss_mode=loss_mode), use_torch_compile=False,
                                ppo_micro_batch_size_per_gpu=self.mbs, **actor_extra)
        self.worker.set_loss_fn(partial(ppo_loss, config=actor))

    def reset_weights(self) -> None:
        self.engine.module.load_state_dict(self.initial)

    def run_td(self, td, options: dict | None | str, *, agg="token-mean", loss_mode="vanilla", **actor_extra) -> Run:
        """``train_mini_batch(td)`` from the initial weights; ``options="as is"`` leaves the patches alone."""
        from verl.utils import tensordict_utils as tu

        self.reset_weights()
        self.set_loss(agg=agg, loss_mode=loss_mode, **actor_extra)
        if options != "as is":
            patches(options)
        self.current = run = Run()
        try:
            out = self.worker.train_mini_batch(td)
            run.status = verl_status()
        finally:
            self.current = None
            if options != "as is":
                patches(None)
        run.metrics = tu.get(out, "metrics") if out is not None else {}
        return run


_SHARED: dict = {}


def shared_worker(*, dynamic: bool = False, fused: bool = False, remove_padding: bool = False) -> "EngineWorker":
    """One engine worker per kind for the whole process (each build costs seconds): every test
    module reuses it (the worker resets its weights before each run)."""
    key = (dynamic, fused, remove_padding)
    if key not in _SHARED:
        if "dir" not in _SHARED:
            from grpo_patches_testing import scratch

            _SHARED["dir"] = scratch.directory("verl_")
        _SHARED[key] = EngineWorker(model_dir(_SHARED["dir"], fused=fused), dynamic=dynamic, fused=fused,
                                    remove_padding=remove_padding)
    return _SHARED[key]


def engine_batch(rank=0, world=1, *, mini_rows=ROWS, epochs=1, zero="interleaved", extra: dict | None = None,
                 calculate_entropy: bool = False):
    """The v0 trainer's ``update_actor`` input (``RayPPOTrainer._update_actor``), this rank's rows."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    batch = rank_rows(make_batch(zero_rows=ZERO_ROWS[zero], world=world), rank)
    batch.update({k: v[: len(batch["advantages"])] for k, v in (extra or {}).items()})
    td = left_right_2_no_padding(DataProto.from_dict(tensors=batch, meta_info={"temperature": 1.0}).to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=calculate_entropy, global_batch_size=mini_rows * world,
                         mini_batch_size=mini_rows * world, epochs=epochs, seed=1,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True)
    return td


# --- the v0 trainer's old-logprob pass, then the update (test_verl_old_logprob_skip, _verify, _megatron) ---

#: ``logprob_skip`` alone: the filter and the minimal pass (``recompute``) have tests of their own
LOGPROB_SKIP = {"zero_advantage_filter": False, "logprob_skip": True, "recompute": False}


class EngineGroup:
    """Stands in for the actor worker group: the real TrainingWorker's forward-only pass, counted."""

    world_size = 1

    def __init__(self, worker):
        self.worker, self.calls = worker, 0

    def compute_log_prob(self, td):
        from verl.utils import tensordict_utils as tu

        self.calls += 1
        from tensordict.tensorclass import NonTensorData

        tu.assign_non_tensor(td, micro_batch_size_per_gpu=4,  # the log-prob pass batches differently
                             global_token_num=NonTensorData(td["input_ids"].offsets().diff().tolist()))
        return self.worker.worker.infer_batch(td)


def v0_trainer(group, *, legacy: bool = False, **config):
    """A v0 ``RayPPOTrainer`` without Ray (only the methods under test run), ``group`` its actor worker group."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = object.__new__(RayPPOTrainer)
    trainer.config = trainer_config(use_kl_loss=False, **config)
    if legacy:
        trainer.use_legacy_worker_impl = "auto"  # 0.7.x reads it (its __init__ sets it); the engine line has none
    trainer.actor_rollout_wg = group
    return trainer


def old_pass_then_update(options, *, mini=16, placeholder=False, worker=None, legacy=False, **config) -> Run:
    """v0 ``RayPPOTrainer._compute_old_log_prob`` (the real method), then the actor's update: on the engine
    worker (``worker``, else the shared one) or, ``legacy``, on a fresh 0.7.x legacy actor.
    ``placeholder``: the update gets placeholder old log-probs whatever the trainer did."""
    from verl import DataProto
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    if not legacy:
        worker = worker or shared_worker()
        worker.reset_weights()
    batch = make_batch()
    batch.pop("old_log_probs")
    data = DataProto.from_dict(tensors=batch, meta_info={"temperature": 1.0})
    patches(options)
    try:
        run = Run()
        group = legacy_group(run, mini=mini) if legacy else EngineGroup(worker)
        trainer = v0_trainer(group, legacy=legacy, mini=mini, **config)
        old, mfu = trainer._compute_old_log_prob(data)
        entropy = agg_loss(loss_mat=old.batch["entropys"], loss_mask=data.batch["response_mask"],
                           loss_agg_mode="token-mean").item()  # the trainer's actor/entropy
        old.batch.pop("entropys")
        data = data.union(old)
        if placeholder:
            from grpo_patches.adapters.verl import placeholders as ph

            data.batch["old_log_probs"] = ph.like(data.batch["response_mask"])
        if legacy:
            run.metrics, run.status = group.actor.update_policy(data), verl_status()
        else:
            td = left_right_2_no_padding(data.to_tensordict())
            tu.assign_non_tensor(td, calculate_entropy=False, global_batch_size=ROWS, mini_batch_size=mini, epochs=1,
                                 seed=1, dataloader_kwargs={"shuffle": False}, compute_loss=True)
            run = worker.run_td(td, "as is")
        run.metrics = {"trainer/actor/entropy": entropy, "trainer/perf/mfu/actor_infer": mfu, **run.metrics}
    finally:
        patches(None)
    run.forwards = group.calls
    return run


def import_worker_modules() -> None:
    """Import the modules whose records run in the actor-update process (in these tests: this one)."""
    import importlib

    from grpo_patches.adapters.verl.skip_guarantee import WORKER_MODULES

    legacy = line().startswith("legacy")
    for name in WORKER_MODULES:
        if legacy == name.endswith("dp_actor"):
            importlib.import_module(name)
