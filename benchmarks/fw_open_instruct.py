"""The cross-framework workload in open-instruct: its real DeepSpeed learner, from a source checkout.

Real open-instruct code: ``PolicyTrainerRayProcess.from_pretrained`` (its DeepSpeed set-up, ZeRO-2,
its ``load_ref_policy`` reference engine) and ``step()``, one per optimizer step, in this process on
a gloo group of one (:mod:`grpo_patches_testing.open_instruct_cpu`: the CPU stand-ins it needs, fp32,
SGD). Its batches are what its ``DataPreparationActor`` makes (``pack_sequences`` and
``prepare_collated_data_for_workers``, :mod:`grpo_patches_testing.open_instruct_batches`): the
workload's prompts x generations responses of random tokens (the engine's log-probs from the initial
weights), the first ``saturated`` prompt groups with one score (advantage exactly 0; open-instruct's
``filter_zero_std_samples=False``, so they reach the learner), packed into rows of 64 tokens, one row
per micro-batch; the tiny Qwen2 at the workload's size. Generation is not part of it (0 s).

Unpatched, the learner builds the reference engine (open-instruct's default ``load_ref_policy=True``)
and runs it at beta 0; patched (``grpo_patches.enable("open_instruct")``, the defaults) it builds none,
skips the zero-advantage micro-batches and, with ``mini_batches`` > 1, the pre-pass of the first
accumulation group. Reported: ``step()`` seconds (wall and CPU), reference / old-logprob micro-batch
forwards, rows dropped (``grpo_patches/rows_dropped`` in open-instruct's metrics), the policy tokens
through the training forwards, peak RSS (with and without the reference copy). Called by
``_framework_worker.py``; the source comes on ``PYTHONPATH`` (``frameworks.py --open-instruct-tag``).
"""

from __future__ import annotations

from typing import Any

import workload

PACK = 64


def run(spec: dict[str, Any], patched: bool, weights: str) -> dict[str, Any]:
    import torch

    from grpo_patches import registry
    from grpo_patches_testing import open_instruct_cpu as harness

    harness.load()
    version = str(registry.get("open_instruct").installed_version())
    config = harness.Config(
        steps=spec["steps"], prompts=spec["prompts"], samples_per_prompt=spec["generations"],
        zero_std_groups=spec["saturated"], pack_length=PACK, num_mini_batches=spec.get("mini_batches", 1),
        learning_rate=spec["lr"], seed=spec["seed"], model_size=(spec["hidden"], spec["layers"]),
        enable={} if patched else None)
    result = harness.train(config)
    torch.save(result.weights, weights)
    rows_dropped = int(sum(m.get("grpo_patches/rows_dropped", 0) for m in result.metrics))
    skipped = int(sum(m.get("grpo_patches/old_logprob_rows_skipped", 0) for m in result.metrics))
    total = sum(result.micro_batches) * config.per_device_train_batch_size
    return {"version": version, "line": "DeepSpeed learner (PolicyTrainerRayProcess.step)",
            "steps": [{"generation": 0.0, "trainer_side": wall, "cpu_trainer_side": cpu}
                      for wall, cpu in result.step_seconds],
            "old_logprob_passes": result.old_logprob_forwards, "reference_passes": result.ref_forwards,
            "rows_dropped": rows_dropped, "rows_total": total,
            "old_logprob_rows": result.old_logprob_forwards * config.per_device_train_batch_size,
            "old_logprob_rows_net": True, "old_logprob_rows_skipped": skipped, "policy_tokens": result.policy_tokens,
            "reference_model_built": result.ref_model_built, "workload": workload.describe(spec)}
