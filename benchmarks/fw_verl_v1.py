"""The cross-framework workload through verl's real entry point (engine line, verl 0.9+):
``python -m verl.trainer.main_ppo`` with its default V1 trainer (TransferQueue between stages,
engine workers in Ray), as a user runs it.

Each run starts a Ray cluster of its own, runs ``main_ppo`` on it (``GRPO_PATCHES=verl`` for the
patched run, the defaults), and stops it. verl's GRPO config as the legacy row's: KL loss on at
coefficient 0, one mini-batch, one epoch, SGD; FSDP2 in fp32 on the CPU platform and the CPU
stand-in rollout of the end-to-end tests (``tests/grpo-patches-testing/grpo_patches_testing/verl_main_ppo_plugin.py``: no rollout backend of
verl runs on CPU), whose completions are pseudo-random tokens seeded by (step, prompt, sample):
both runs train on the same rollouts, and generation costs next to nothing. The prompts are the
workload's, repeated every step; :func:`compute_score` is ``workload.reward`` (the saturated
prompts' groups get a constant reward).

Measured from verl's own timing metrics per step: the trainer side is ``old_log_prob + ref +
adv + update_actor`` (the stages the patches touch), generation is ``gen``; the old-logprob and
reference passes are counted from verl's metrics (``grpo_patches/old_logprob_passes_skipped``,
a ``timing_s/ref`` entry), and the old-logprob rows as the rows of the passes run less
``grpo_patches/old_logprob_rows_skipped``; ``spec["mini_batches"]`` is ``e2e.train``'s
``mini_batches`` (its completions are the stand-in rollout's: ``variable_lengths`` changes only
the prompts). The peak RSS is the training worker's, and so are the policy tokens: the token
positions of ``input_ids`` through the actor's forwards with gradients (remove-padding is on, as
in verl's example: rows packed without padding, so this counts the kept rows' own tokens), and
the policy calls are those forwards (one per forward/backward micro-batch). No CPU seconds: the stages
run in other processes. Called by ``_framework_worker.py``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

TRAINER_SIDE = ("timing_s/old_log_prob", "timing_s/ref", "timing_s/adv", "timing_s/update_actor")


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **_: Any) -> float:
    """``workload.reward``, the prompt's part carried in ``ground_truth``: ``"const:<k>"`` for a
    saturated prompt, ``"hash"`` for the others (imports nothing: verl loads it by path)."""
    if ground_truth.startswith("const:"):
        return float(ground_truth.split(":", 1)[1])
    return (sum(ord(c) for c in solution_str) % 97) / 97.0


def _dataset(spec: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The workload's prompts once per step (``trainer.total_epochs=1``), with their reward rule."""
    import workload  # not at the top: verl's reward workers load this file by path for compute_score

    texts = workload.prompt_texts(spec)
    truths = [f"const:{float(workload.reward(spec, t, ''))}" if i < spec["saturated"] else "hash"
              for i, t in enumerate(texts)]
    return texts * spec["steps"], truths * spec["steps"]


def run(spec: dict[str, Any], patched: bool, weights: str) -> dict[str, Any]:
    from importlib import metadata

    import torch
    from packaging.version import Version

    version = metadata.version("verl")
    if Version(version) < Version("0.9"):
        return {"not_run": f"verl {version}: the V1 trainer runner needs verl 0.9+ (the legacy row runs 0.6-0.7)"}
    from grpo_patches_testing import verl_main_ppo as e2e

    load = e2e.Workload(prompts=spec["prompts"], samples=spec["generations"], steps=spec["steps"], max_prompt=32,
                        max_response=spec["completion_tokens"], micro_rows=spec["micro_rows"], lr=spec["lr"],
                        hidden=spec["hidden"], layers=spec["layers"], reward=f"{Path(__file__).resolve()}:compute_score")
    with tempfile.TemporaryDirectory(prefix="grpo_bench_verl_v1_") as tmp:
        prompts, truths = _dataset(spec)
        assets = e2e.build_assets(Path(tmp, "assets"), load, prompts=prompts, ground_truths=truths)
        cluster = e2e.RayCluster()
        try:
            result = e2e.train(assets, cluster, Path(tmp, "run"), v1=True, mini_batches=spec.get("mini_batches", 1),
                               patches={} if patched else None, workload=load)
        finally:
            cluster.stop()
    torch.save(result.weights, weights)
    steps = [{"generation": m.get("timing_s/gen", 0.0), "trainer_side": sum(m.get(k, 0.0) for k in TRAINER_SIDE)}
             for m in result.metrics]
    skipped = sum(int(m.get("grpo_patches/old_logprob_passes_skipped", 0)) for m in result.metrics)
    rows_skipped = sum(int(v) for m in result.metrics for k, v in m.items()
                       if k.endswith("grpo_patches/old_logprob_rows_skipped"))
    return {"version": version, "line": "V1 trainer (main_ppo, engine workers)", "steps": steps,
            "old_logprob_passes": len(result.metrics) - skipped,
            "reference_passes": sum("timing_s/ref" in m for m in result.metrics),
            # the worker's total: verl logs the mean of a step's mini-batches under actor/grpo_patches/rows_dropped
            "rows_dropped": int(result.status.get("savings", {}).get("rows_dropped", 0)),
            "rows_total": spec["prompts"] * spec["generations"] * len(result.metrics),
            "old_logprob_rows": (len(result.metrics) - skipped) * spec["prompts"] * spec["generations"],
            "old_logprob_rows_skipped": rows_skipped,
            "peak_rss_mb": result.peak_rss_mb, "policy_tokens": result.policy_tokens,
            "policy_calls": result.policy_calls}
