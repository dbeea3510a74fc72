"""verl 0.9's V1 trainer (``verl.trainer.ppo.v1.trainer_base.PPOTrainer``): its real
``_compute_old_log_prob`` then ``_update_actor`` on the engine worker, one rank, with an
in-memory TransferQueue kept row by row (a key subset reads and writes only its own rows, as
TransferQueue does): for the minimal-pass tests (option ``recompute``).

The worker group stands in for Ray's: ``compute_log_prob(meta)`` runs the real
``TrainingWorker.infer_batch`` on the meta's keys and writes ``log_probs``/``entropy`` back for
them (the worker-side TransferQueue bridge's job); ``update_actor(meta)`` feeds the keys' rows,
with the meta's ``extra_info``, to the real ``train_mini_batch``.
"""

from __future__ import annotations

from typing import Any

import torch

from grpo_patches_testing import verl_actor_runs as h

from grpo_patches_testing import verl_engine_runs as engine_runs
from grpo_patches_testing import verl_minimal_pass as m

#: The outputs of the pass the update does not read (the real update gets its own forward's).
_PASS_OUTPUTS = ("log_probs", "entropy")


class KeyStore:
    """``kv_batch_get`` / ``kv_batch_put`` of TransferQueue, in memory, one tensor per key and field."""

    def __init__(self, td: Any):
        self.rows: dict[str, dict[str, Any]] = {}
        self.nested: set[str] = set()
        self.keys = [f"k{i}" for i in range(len(td))]
        self.inputs = [name for name, value in td.items() if isinstance(value, torch.Tensor)]
        self._put(self.keys, td)

    def _put(self, keys: list[str], fields: Any) -> None:
        for name, value in fields.items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.is_nested:
                self.nested.add(name)
            self.rows.setdefault(name, {}).update(zip(keys, value.unbind(0)))

    def kv_batch_get(self, keys: list[str], partition_id: str, select_fields: list[str]) -> Any:
        from tensordict import TensorDict

        out = {}
        for name in select_fields:
            if name in self.rows:  # verl asks for optional fields too
                parts = [self.rows[name][k] for k in keys]
                out[name] = (torch.nested.as_nested_tensor(parts, layout=torch.jagged) if name in self.nested
                             else torch.stack(parts))
        return TensorDict(out, batch_size=[len(keys)])

    def kv_batch_put(self, keys: list[str], partition_id: str, fields: Any = None, tags: Any = None) -> Any:
        from transfer_queue import KVBatchMeta

        if fields is not None:
            self._put(list(keys), fields)
        return KVBatchMeta(keys=list(keys), partition_id=partition_id, tags=[{} for _ in keys])  # fresh metadata


class Group:
    """The actor worker group of ``world`` ranks, seen from rank ``rank`` (no Ray actors: the
    probe of its workers runs here). Every rank runs the pass on all the rows it is given (so an
    FSDP-sharded model's collectives match); the update gets this rank's chunk (``KVBatchMeta.chunk``)."""

    workers: list = []

    def __init__(self, worker: Any, store: KeyStore, world: int = 1, rank: int = 0):
        self.worker, self.store, self.world_size, self.rank = worker, store, world, rank
        self.rows = 0  # rows through the old-logprob pass

    def _td(self, meta: Any, fields: list[str]) -> Any:
        from verl.utils import tensordict_utils as tu

        td = self.store.kv_batch_get(meta.keys, meta.partition_id, fields)
        tu.assign_non_tensor(td, **meta.extra_info)
        return td

    def compute_log_prob(self, meta: Any) -> Any:
        from tensordict.tensorclass import NonTensorData
        from verl.utils import tensordict_utils as tu

        assert len(meta) % self.world_size == 0, f"{len(meta)} rows do not chunk over {self.world_size} ranks"
        self.rows += len(meta)
        td = self._td(meta, self.store.inputs)
        sizes = {"micro_batch_size_per_gpu": 4, "max_token_len_per_gpu": 40}  # the rollout.log_prob_* sizes
        tu.assign_non_tensor(td, **{k: v for k, v in sizes.items() if k not in td.keys()},  # as infer_batch: a size
                             global_token_num=NonTensorData(td["input_ids"].offsets().diff().tolist()))  # given stays
        out = self.worker.worker.infer_batch(td)
        self.store.kv_batch_put(meta.keys, meta.partition_id, fields=out.select(*_PASS_OUTPUTS))
        return meta

    def update_actor(self, meta: Any) -> Any:
        from verl.utils import tensordict_utils as tu

        td = self._td(meta.chunk(self.world_size)[self.rank], [*self.store.inputs, "old_log_probs"])
        out = self.worker.worker.train_mini_batch(td)
        return {"metrics": tu.get(out, "metrics")}


def rollout_rows(zero: tuple[int, ...], world: int = 1) -> Any:
    """:func:`verl_actor_runs.make_batch`'s rows as the V1 agent loop puts them into TransferQueue:
    one unpadded row per key (prompt, response, ``input_ids`` = both), jagged (``list_of_dict_to_tensordict``)."""
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    batch = h.make_batch(zero_rows=zero, world=world)
    rows = []
    for i in range(len(batch["input_ids"])):
        real = batch["attention_mask"][i].bool()
        prompt, response = real[: h.PROMPT], real[h.PROMPT:]
        ids = batch["input_ids"][i][real]
        mask = batch["response_mask"][i][response]
        rows.append({"prompts": batch["prompts"][i][prompt], "responses": batch["responses"][i][response],
                     "response_mask": mask, "loss_mask": mask, "input_ids": ids,
                     "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(len(ids)),
                     "advantages": batch["advantages"][i][response]})
    return list_of_dict_to_tensordict(rows)


def trainer(config: Any, group: Group, base: type | None = None) -> Any:
    """A V1 ``PPOTrainer`` (or ``base``, a subclass) with no Ray and no TransferQueue service:
    only the methods under test run."""
    from verl.trainer.ppo.v1 import trainer_base

    base = base or trainer_base.PPOTrainer
    abstract = {name: (lambda self, *a, **k: None) for name in getattr(base, "__abstractmethods__", ())}
    concrete = type("V1Trainer", (base,), abstract)
    t = object.__new__(concrete)
    t.config = config
    t.actor_rollout_wg = group
    return t


def run(options: dict | None, *, n_mini: int, epochs: int = 1, shuffle: bool = False, dynamic: bool = False,
        zero: tuple[int, ...] = h.ZERO_ROWS["interleaved"], monkeypatch: Any = None, base: type | None = None,
        rank: int = 0, world: int = 1, worker: Any = None) -> h.Run:
    """One V1 trainer step (old-logprob pass, advantage stage's put, update) patched with ``options``;
    ``base``: a subclass of ``PPOTrainer`` to run instead; ``rank``/``world``: this data-parallel rank
    (``worker``: its engine worker); ``monkeypatch``: where to replace verl's TransferQueue binding."""
    from omegaconf import OmegaConf
    from tensordict import TensorDict
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1 import trainer_base

    worker = worker or engine_runs.shared_worker(dynamic=dynamic)
    td = rollout_rows(zero, world)
    store = KeyStore(td)
    if monkeypatch is not None:
        monkeypatch.setattr(trainer_base, "tq", store)
    else:  # a spawned rank: its own process
        trainer_base.tq = store
    config = OmegaConf.merge(m.trainer_config(mini=h.ROWS // n_mini * world, epochs=epochs, shuffle=shuffle, seed=1,
                                              dynamic=dynamic),
                             {"actor_rollout_ref": {"rollout": {"calculate_log_probs": False}},
                              "algorithm": {"rollout_correction": None}})
    group = Group(worker, store, world, rank)
    t = trainer(config, group, base)
    worker.reset_weights()
    worker.set_loss()
    result = h.Run()
    worker.current = result
    h.patches(options)
    metrics: dict = {}
    try:
        meta = KVBatchMeta(keys=list(store.keys), partition_id="train", tags=[{} for _ in store.keys],
                           extra_info={"temperature": 1.0})
        meta = t._compute_old_log_prob(meta, metrics)
        # the advantage stage's put (the same advantages): the update gets fresh metadata
        meta = store.kv_batch_put(meta.keys, "train", fields=TensorDict({"advantages": td["advantages"]},
                                                                          batch_size=[len(store.keys)]))
        t._update_actor(meta, metrics)
        result.status = h.verl_status()
    finally:
        worker.current = None
        h.patches(None)
    result.metrics = metrics
    result.forwards = group.rows
    return result
