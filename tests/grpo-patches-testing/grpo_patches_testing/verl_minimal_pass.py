"""The trainer's old-logprob pass then the actor update, through verl's real ``RayPPOTrainer``
methods (``_compute_old_log_prob``, ``_update_actor``), on one data-parallel rank: for the
minimal-pass tests (option ``recompute``) and benchmarks.

The worker group stands in for Ray's: ``compute_log_prob`` runs the real actor's forward-only
pass on the rows it is given (every rank runs the same rows, so an FSDP-sharded model's
collectives match; the dispatch's divisibility by the data-parallel size is asserted);
``update_actor`` hands this rank its contiguous chunk, as verl's dispatch does.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo_patches_testing import verl_actor_runs as h


def trainer_config(*, mini: int, epochs: int = 1, shuffle: bool = False, seed: int = 42, dynamic: bool = False) -> Any:
    """The trainer's config as the methods under test read it (log-prob micro-batches of 4 rows: :class:`Group`)."""
    from omegaconf import OmegaConf

    config = h.trainer_config(use_kl_loss=False, mini=mini, epochs=epochs)
    return OmegaConf.merge(config, {
        "actor_rollout_ref": {"actor": {"shuffle": shuffle, "data_loader_seed": seed, "entropy_coeff": 0.0,
                                        "calculate_entropy": False, "strategy": "fsdp"},
                              "rollout": {"multi_turn": {"enable": False}, "log_prob_micro_batch_size_per_gpu": 4,
                                          "log_prob_use_dynamic_bsz": dynamic}},
        "trainer": {"balance_batch": False},
    })


class Group:
    """The actor worker group of one rank: ``world_size`` ranks, this one ``rank``; rows and passes counted."""

    def __init__(self, actor: Any, world: int, rank: int, engine: bool):
        self.actor, self.world_size, self.rank, self.engine = actor, world, rank, engine
        self.rows = 0  # rows through the old-logprob pass
        self.calls = 0  # old-logprob passes

    def compute_log_prob(self, data: Any) -> Any:
        assert len(data) % self.world_size == 0, f"{len(data)} rows do not chunk over {self.world_size} ranks"
        self.rows += len(data)
        self.calls += 1
        if self.engine:
            from tensordict.tensorclass import NonTensorData
            from verl.utils import tensordict_utils as tu

            sizes = {"micro_batch_size_per_gpu": 4, "max_token_len_per_gpu": 40}  # as infer_batch: a size given stays
            tu.assign_non_tensor(data, **{k: v for k, v in sizes.items() if k not in data.keys()},
                                 global_token_num=NonTensorData(data["input_ids"].offsets().diff().tolist()))
            return self.actor.worker.infer_batch(data)
        from verl import DataProto

        data.meta_info.update(micro_batch_size=4, max_token_len=40, use_dynamic_bsz=False, temperature=1.0)
        out = self.actor.compute_log_prob(data, calculate_entropy=True)
        log_probs, entropys = (out["log_probs"], out["entropys"]) if isinstance(out, dict) else out
        return DataProto.from_dict(tensors={"old_log_probs": log_probs, "entropys": entropys})

    def update_actor(self, data: Any) -> Any:
        per = len(data) // self.world_size
        if self.engine:
            from verl.utils import tensordict_utils as tu

            mine = tu.index_select_tensor_dict(data, torch.arange(self.rank * per, (self.rank + 1) * per))
            return self.actor.worker.train_mini_batch(mine)
        from verl import DataProto

        mine = data.select_idxs(torch.arange(self.rank * per, (self.rank + 1) * per))
        return DataProto(meta_info={"metrics": self.actor.update_policy(mine)})


def legacy_group(run: h.Run, *, mini: int = h.ROWS, world: int = 1, rank: int = 0, shard: bool = False,
                 **actor_config: Any) -> Group:
    """A fresh 0.7.x legacy actor on the tiny model (FSDP2-sharded if ``shard``) behind this rank's
    worker group, the gradients before each optimizer step recorded into ``run``."""
    model = h.tiny_model(0)
    if shard:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    actor = h.legacy_actor(model, mini=mini, **actor_config)
    step = actor._optimizer_step
    actor._optimizer_step = lambda: (run.grads.append(h.grads_of(model.parameters())), step())[1]
    return Group(actor, world, rank, engine=False)


def zero_rows(fraction: float, rows: int = h.ROWS) -> tuple[int, ...]:
    """Every rank's zero-advantage rows: ``fraction`` of them, spread over the batch."""
    count = round(fraction * rows)
    return tuple(sorted({int(i * rows / count) for i in range(count)})) if count else ()


def run(options: dict | None, *, n_mini: int, epochs: int = 1, shuffle: bool = False, dynamic: bool = False,
        zero: tuple[int, ...] = h.ZERO_ROWS["interleaved"], rank: int = 0, world: int = 1, shard: bool = False,
        worker: Any = None, trainer_class: type | None = None) -> h.Run:
    """One trainer step (old-logprob pass, update) patched with ``options`` (``None``: off).
    ``worker``: an :class:`~verl_engine_runs.EngineWorker` (engine line), else the legacy actor;
    ``trainer_class``: a ``RayPPOTrainer`` subclass to run the methods of."""
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    mini = h.ROWS // n_mini  # rows per rank and mini-batch
    trainer = object.__new__(trainer_class or RayPPOTrainer)  # no Ray: only the methods under test run
    trainer.config = trainer_config(mini=mini * world, epochs=epochs, shuffle=shuffle, dynamic=dynamic)
    trainer.use_legacy_worker_impl = "disable" if worker is not None else "auto"
    h.patches(options)
    result = h.Run()
    if worker is not None:
        worker.reset_weights()
        worker.set_loss()
        worker.current = result
        trainer.actor_rollout_wg = Group(worker, world, rank, engine=True)
    else:
        trainer.actor_rollout_wg = legacy_group(result, mini=mini, world=world, rank=rank, shard=shard, epochs=epochs,
                                                dynamic=dynamic)
    batch = h.make_batch(zero_rows=zero, world=world)
    batch.pop("old_log_probs")
    data = DataProto.from_dict(tensors=batch, meta_info={"temperature": 1.0})
    try:
        old, _ = trainer._compute_old_log_prob(data)
        old.batch.pop("entropys")
        data = data.union(old)
        output = trainer._update_actor(data)
        result.metrics = dict(output.meta_info["metrics"])
        result.status = h.verl_status()
    finally:
        if worker is not None:
            worker.current = None
        h.patches(None)
    result.forwards = trainer.actor_rollout_wg.rows
    return result
