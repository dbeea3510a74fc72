"""The cross-framework workload in TRL: the real ``GRPOTrainer`` with TRL's default schedule.

``steps_per_generation`` = ``gradient_accumulation_steps`` (TRL's default): one generation per
optimizer step, so TRL itself computes no old log-probs, and ``beta=0`` (no reference model):
the only trainer-side saving left is the zero-advantage filter. Times come from
:class:`grpo_patches.demo.step_timer.StepTimer` (installed beneath the patches, so a pass the
patches skip costs nothing there); generation (sampling, rewards, advantages) is apart.
With ``spec["mini_batches"]`` = N > 1 one generation feeds N optimizer steps
(``steps_per_generation`` = the rollout's micro-batches, ``gradient_accumulation_steps`` = 1/N
of them): TRL computes old log-probs, and the times are summed per rollout batch. Rows and
tokens through TRL's log-prob method are counted beneath the patches (what really ran).
Called by ``_framework_worker.py``.
"""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import workload


def run(spec: dict[str, Any], patched: bool, weights: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    import torch
    from importlib import metadata

    from trl import GRPOConfig, GRPOTrainer

    import grpo_patches
    from grpo_patches import savings
    from grpo_patches.demo import tiny_model
    from grpo_patches.demo.step_timer import StepTimer

    timer = StepTimer()
    timer.install(GRPOTrainer)  # beneath the patches: counts only the forwards that really run
    if patched:
        grpo_patches.enable("trl", pack_kept_rows=bool(spec.get("pack_kept_rows")))  # the defaults (+ --pack)
    tmp = tempfile.mkdtemp(prefix="grpo_bench_trl_")
    path = tiny_model.tiny_model_path(tmp, seed=spec["seed"], hidden_size=spec["hidden"], num_layers=spec["layers"],
                                      eos_boost=workload.eos_boost(spec))
    rows, batches = spec["prompts"] * spec["generations"], spec.get("mini_batches", 1)
    config = GRPOConfig(
        output_dir=tmp, per_device_train_batch_size=spec["micro_rows"], **schedule(spec),
        num_generations=spec["generations"],
        max_completion_length=spec["completion_tokens"], beta=0.0, learning_rate=spec["lr"], optim="sgd",
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", seed=spec["seed"], use_cpu=True,
        bf16=False, report_to="none", disable_tqdm=True,
    )

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        return [workload.reward(spec, p, c) for p, c in zip(prompts, completions)]

    from datasets import Dataset

    trainer = GRPOTrainer(model=path, reward_funcs=reward, args=config, processing_class=tiny_model.load_tokenizer(path),
                          train_dataset=Dataset.from_dict({"prompt": workload.prompt_texts(spec)}))
    timer.attach(trainer)
    trainer.train()
    torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, weights)
    saved = savings.totals("trl") if patched else {}
    return {"version": metadata.version("trl"), "line": "GRPOTrainer", "steps": per_rollout(timer.steps, batches),
            "old_logprob_passes": timer.passes["old_logprob_passes"], "reference_passes": timer.passes["reference_passes"],
            "rows_dropped": int(saved.get("rows_dropped", 0)), "rows_total": rows * spec["steps"],
            "old_logprob_rows": timer.rows["old_logprobs"], "old_logprob_rows_net": True,
            "policy_tokens": timer.tokens["policy_with_grad"], "policy_calls": timer.policy_calls,
            "old_logprob_rows_skipped": int(saved.get("old_logprob_rows_skipped", 0)),
            "padding_tokens_skipped": int(saved.get("padding_tokens_skipped", 0))}


def schedule(spec: dict[str, Any]) -> dict[str, int]:
    """TRL's schedule for ``spec``: one generation per rollout batch, ``mini_batches`` optimizer
    steps consuming it, ``steps`` rollout batches.

    :raises ValueError: the rollout's micro-batches do not split into ``mini_batches`` steps.
    """
    batches = spec.get("mini_batches", 1)
    micro_batches = spec["prompts"] * spec["generations"] // spec["micro_rows"]
    if micro_batches % batches:
        raise ValueError(f"--mini-batches {batches}: the rollout's {micro_batches} micro-batches of "
                         f"{spec['micro_rows']} rows do not split into {batches} optimizer steps")
    return {"max_steps": spec["steps"] * batches, "gradient_accumulation_steps": micro_batches // batches,
            "steps_per_generation": micro_batches}


def per_rollout(steps: list[dict[str, float]], batches: int) -> list[dict[str, float]]:
    """Optimizer steps' times summed per rollout batch (``batches`` steps each)."""
    return [{key: sum(s[key] for s in steps[i:i + batches]) for key in steps[i]}
            for i in range(0, len(steps) - batches + 1, batches)]
