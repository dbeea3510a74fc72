"""The cross-framework workload in verl (legacy worker line, 0.6.1-0.7.1; its default there).

One process, no Ray: verl's own trainer methods run on a ``RayPPOTrainer`` built without
``__init__`` (``need_reference_policy``, ``_compute_old_log_prob``, ``compute_advantage``), whose
worker groups call a real ``DataParallelPPOActor`` (policy) and a second one (reference) in
this process, as ``fit()`` does per step. Generation is HF ``generate`` from the policy,
timed apart. The GRPO config is verl's example one with the KL loss on at coefficient 0
(``use_kl_loss=True, kl_loss_coef=0``: verl still builds and runs the reference) and one
mini-batch, one epoch (verl computes old log-probs it then ignores); ``spec["mini_batches"]``
= N sets ``ppo_mini_batch_size`` to 1/N of the batch (N optimizer steps per rollout batch).
Rows through the old-logprob pass are counted by the worker group (net: with ``recompute`` the
trainer's ``_update_actor`` hands it only the rows a loss reads after an optimizer step); the
rows whose pass the patches skipped are read from verl's metrics
(``grpo_patches/old_logprob_rows_skipped``, absent = 0). Policy tokens: rows x columns of
``input_ids`` through the policy's forwards with gradients (the update's; verl pads them here:
no remove-padding), counted by a forward pre-hook beneath the patches. With ``variable_lengths`` the policy is the tiny model with a boosted ``<eos>``. Called by
``_framework_worker.py``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import workload


class _Group:
    """A worker group of one: the trainer calls it, the real actor answers; passes are counted."""

    world_size = 1

    def __init__(self, actor: Any, micro: int) -> None:
        self.actor, self.micro, self.calls, self.rows = actor, micro, 0, 0

    def _log_probs(self, data: Any, key: str, entropy: bool) -> Any:
        from verl import DataProto

        self.calls += 1
        self.rows += len(data)
        data.meta_info.update(micro_batch_size=self.micro, max_token_len=4096, use_dynamic_bsz=False, temperature=1.0)
        out = self.actor.compute_log_prob(data, calculate_entropy=entropy)
        log_probs, entropys = (out["log_probs"], out.get("entropys")) if isinstance(out, dict) else out
        tensors = {key: log_probs, **({"entropys": entropys} if entropy else {})}
        return DataProto.from_dict(tensors=tensors)

    def compute_log_prob(self, data: Any) -> Any:
        return self._log_probs(data, "old_log_probs", True)

    def update_actor(self, data: Any) -> Any:
        from verl import DataProto

        return DataProto(meta_info={"metrics": self.actor.update_policy(data)})

    def compute_ref_log_prob(self, data: Any) -> Any:
        return self._log_probs(data, "ref_log_prob", False)


class _TokenCounter:
    """Token positions (rows x columns of ``input_ids``) and calls through a model's forwards with
    gradients: the policy update's forward/backward calls (the log-prob passes run without gradients)."""

    def __init__(self, model: Any) -> None:
        self.tokens = self.calls = 0
        model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: Any, args: tuple, kwargs: dict) -> None:
        import torch

        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and torch.is_grad_enabled():
            self.tokens += int(ids.numel())
            self.calls += 1


def _config(spec: dict[str, Any]) -> Any:
    from omegaconf import OmegaConf

    mini = spec["prompts"] // spec.get("mini_batches", 1)  # verl counts prompts here (x rollout.n rows)
    return OmegaConf.create({
        "actor_rollout_ref": {"actor": {"use_kl_loss": True, "kl_loss_coef": 0.0, "ppo_mini_batch_size": mini,
                                        "ppo_epochs": 1, "loss_agg_mode": "token-mean", "loss_scale_factor": None},
                              "rollout": {"n": spec["generations"], "temperature": 1.0, "multi_turn": {"enable": False}}},
        "algorithm": {"use_kl_in_reward": False, "kl_ctrl": {"type": "fixed", "kl_coef": 0.0}, "adv_estimator": "grpo",
                      "gamma": 1.0, "lam": 1.0, "norm_adv_by_std_in_grpo": True},
    })


def _actor(model: Any, spec: dict[str, Any]) -> Any:
    import torch
    from verl.workers.actor.dp_actor import DataParallelPPOActor
    from verl.workers.config import FSDPActorConfig, FSDPEngineConfig

    rows = spec["prompts"] * spec["generations"]
    config = FSDPActorConfig(strategy="fsdp", rollout_n=spec["generations"],
                             ppo_mini_batch_size=rows // spec.get("mini_batches", 1),
                             ppo_micro_batch_size_per_gpu=spec["micro_rows"], ppo_epochs=1, loss_agg_mode="token-mean",
                             use_kl_loss=True, kl_loss_coef=0.0, use_torch_compile=False,
                             fsdp_config=FSDPEngineConfig(dtype="float32"))
    return DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=spec["lr"]))


def _rollouts(model: Any, tokenizer: Any, spec: dict[str, Any], step: int) -> Any:
    """Sample, score and pack one step's rollouts as verl's trainer holds them (a ``DataProto``)."""
    import numpy as np
    import torch
    from verl import DataProto

    prompts = workload.prompt_texts(spec)
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(spec["seed"] * 1000 + step)
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, max_new_tokens=spec["completion_tokens"],
                             num_return_sequences=spec["generations"], pad_token_id=0, eos_token_id=1)
    p = enc["input_ids"].size(1)
    prompt_mask = enc["attention_mask"].repeat_interleave(spec["generations"], 0)
    responses = torch.nn.functional.pad(out[:, p:], (0, spec["completion_tokens"] - (out.size(1) - p)))
    ended = (responses == 1).int().cumsum(1)  # response tokens up to and including the first eos
    response_mask = ((ended == 0) | ((ended == 1) & (responses == 1))).long()
    responses = responses * response_mask
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    rows = [p_ for p_ in prompts for _ in range(spec["generations"])]
    scores = torch.zeros(responses.shape)
    last = (response_mask.sum(1) - 1).clamp(min=0)
    scores[torch.arange(len(rows)), last] = torch.tensor([workload.reward(spec, a, b) for a, b in zip(rows, texts)])
    attention = torch.cat([prompt_mask, response_mask], 1)
    tensors = {"prompts": enc["input_ids"].repeat_interleave(spec["generations"], 0), "responses": responses,
               "input_ids": torch.cat([enc["input_ids"].repeat_interleave(spec["generations"], 0), responses], 1),
               "attention_mask": attention, "position_ids": (attention.cumsum(1) - 1).clamp(min=0),
               "response_mask": response_mask, "token_level_scores": scores, "token_level_rewards": scores}
    index = np.array([str(i // spec["generations"]) for i in range(len(rows))], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": index}, meta_info={"temperature": 1.0})


def run(spec: dict[str, Any], patched: bool, weights: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from importlib import metadata

    from grpo_patches import api

    from grpo_patches.demo import tiny_model

    version = metadata.version("verl")
    if tuple(int(x) for x in version.split(".")[:2]) >= (0, 8):
        return {"not_run": f"verl {version}: the engine line (0.8+) has no runner in this benchmark yet "
                           "(its update is measured by the engine tests' harness only)"}
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    if patched:
        api.enable("verl")  # the defaults
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.utils import need_reference_policy

    model = tiny_model.build_model(spec["seed"], spec["hidden"], spec["layers"], eos_boost=workload.eos_boost(spec)).float()
    reference = tiny_model.build_model(spec["seed"], spec["hidden"], spec["layers"],
                                       eos_boost=workload.eos_boost(spec)).float()
    tokenizer = tiny_model.build_tokenizer()
    actor = _actor(model, spec)
    counter = _TokenCounter(model)
    trainer = object.__new__(ray_trainer.RayPPOTrainer)  # no Ray: fit()'s per-step methods on this process
    trainer.config = _config(spec)
    trainer.use_legacy_worker_impl = "auto"
    trainer.actor_rollout_wg = _Group(actor, spec["micro_rows"])
    trainer.ref_policy_wg = _Group(_actor(reference, spec), spec["micro_rows"])
    trainer.use_reference_policy = need_reference_policy(trainer.config)  # as __init__ decides
    steps, dropped, total, skipped = [], 0, 0, 0
    for step in range(spec["steps"]):
        start = time.perf_counter()
        batch = _rollouts(model, tokenizer, spec, step)
        generation = time.perf_counter() - start
        start, cpu = time.perf_counter(), time.process_time()
        old, _ = trainer._compute_old_log_prob(batch)
        old.batch.pop("entropys", None)
        batch = batch.union(old)
        if trainer.use_reference_policy:
            batch = batch.union(trainer.ref_policy_wg.compute_ref_log_prob(batch))
        batch = ray_trainer.compute_advantage(batch, adv_estimator="grpo", num_repeat=spec["generations"],
                                              norm_adv_by_std_in_grpo=True, config=trainer.config.algorithm)
        metrics = trainer._update_actor(batch).meta_info["metrics"]  # as fit() calls it (the deferred pass runs there)
        steps.append({"generation": generation, "trainer_side": time.perf_counter() - start,
                      "cpu_trainer_side": time.process_time() - cpu})  # CPU s: steadier on a shared host
        total += len(batch)
        dropped += int(sum(_as_list(metrics.get("grpo_patches/rows_dropped", 0))))
        skipped += int(sum(_as_list(metrics.get("grpo_patches/old_logprob_rows_skipped", 0))))
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, weights)
    return {"version": version, "line": "legacy DataParallelPPOActor", "steps": steps,
            "old_logprob_passes": trainer.actor_rollout_wg.calls, "reference_passes": trainer.ref_policy_wg.calls,
            "rows_dropped": dropped, "rows_total": total,
            "old_logprob_rows": trainer.actor_rollout_wg.rows, "old_logprob_rows_net": True,
            "old_logprob_rows_skipped": skipped, "policy_tokens": counter.tokens,
            "policy_calls": counter.calls}


def _as_list(value: Any) -> list[float]:
    return [float(v) for v in value] if isinstance(value, (list, tuple)) else [float(value)]
