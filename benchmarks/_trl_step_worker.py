"""One TRL GRPOTrainer training run in a fresh process, timed per component.

Run by ``trl_step.py`` as ``python benchmarks/_trl_step_worker.py '<json spec>'``; writes one
JSON result to ``spec["result_path"]``: per optimizer step, the seconds of each component
(:mod:`grpo_patches.demo.step_timer`), rows through TRL's log-prob method, the loss and grad norm of
every step, and the savings grpo_patches reported.

Generation is replaced by fixed completions (TRL's ``rollout_func``): every completion is
``completion_tokens`` deterministic word ids, distinct per (prompt, generation). In each
rollout the first ``round(zero_fraction * prompts)`` prompts (sorted) get one constant reward
for all their completions (advantage exactly 0); the others a reward from the completion.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
import zlib
from pathlib import Path
from typing import Any


def _fixed_rollouts(tokenizer: Any, completion_tokens: int) -> Any:
    from grpo_patches.demo import tiny_model

    first_word = len(tiny_model.SPECIAL_TOKENS)
    words = len(tiny_model.WORDS)

    def rollout_func(prompts: list[str], trainer: Any) -> dict[str, Any]:
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        seen: dict[str, int] = {}
        completions = []
        for prompt in prompts:
            k = seen[prompt] = seen.get(prompt, -1) + 1
            state = zlib.crc32(f"{prompt}|{k}".encode())
            ids = []
            for _ in range(completion_tokens):
                state = (state * 1103515245 + 12345) % 2**31
                ids.append(first_word + state % words)
            completions.append(ids)
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}

    return rollout_func


def _reward(zero_fraction: float) -> Any:
    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        unique = sorted(set(prompts))
        constant = set(unique[: round(zero_fraction * len(unique))])
        return [1.0 if p in constant else (zlib.crc32(c.encode()) % 97) / 97.0 for p, c in zip(prompts, completions)]

    return reward


def run(spec: dict) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # rollout_func is experimental in TRL
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(spec["threads"])
    from trl import GRPOConfig, GRPOTrainer

    import grpo_patches
    from grpo_patches import savings
    from grpo_patches.demo import tiny_model
    from grpo_patches.demo.step_timer import StepTimer

    timer = StepTimer()
    timer.install(GRPOTrainer)  # beneath the patches: counts only forwards that really run
    if spec["options"] is not None:
        grpo_patches.enable("trl", **spec["options"])
    path = tiny_model.tiny_model_path(spec["model_dir"], hidden_size=spec["hidden"], num_layers=spec["layers"],
                                      vocab_size=spec["vocab"])
    tokenizer = tiny_model.load_tokenizer(path)
    config = GRPOConfig(
        output_dir=spec["output_dir"], max_steps=spec["steps"], per_device_train_batch_size=spec["rows"],
        num_generations=spec["generations"], max_completion_length=spec["completion_tokens"],
        gradient_accumulation_steps=spec["ga"], steps_per_generation=spec["spg"], beta=0.0,
        learning_rate=1e-5, logging_steps=1, save_strategy="no", seed=0, use_cpu=spec.get("device", "cpu") == "cpu", bf16=False,
        report_to="none", disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=path, reward_funcs=_reward(spec["zero_fraction"]), args=config,
        train_dataset=tiny_model.prompt_dataset(spec["prompts"], words_per_prompt=spec["prompt_words"]),
        processing_class=tokenizer, rollout_func=_fixed_rollouts(tokenizer, spec["completion_tokens"]),
    )
    timer.attach(trainer)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    logs = trainer.state.log_history
    return {
        "status": "ok",
        "per_step": timer.per_step(skip=spec["warmup"]),
        "steps": timer.steps,
        "rows": timer.rows,
        "policy_calls_per_step": timer.policy_calls / max(len(timer.steps), 1),
        "loss": [row["loss"] for row in logs if "loss" in row],
        "grad_norm": [row["grad_norm"] for row in logs if "grad_norm" in row],
        "frac_reward_zero_std": [row["frac_reward_zero_std"] for row in logs if "frac_reward_zero_std" in row],
        "savings": savings.totals("trl"),
        "verify_figures": {name: max(row[name] for row in logs if name in row)
                           for name in {n for row in logs for n in row if n.startswith("grpo_patches/verify/")}},
        "wall_s": wall,
        "torch_threads": torch.get_num_threads(),
    }


def main() -> int:
    spec = json.loads(sys.argv[1])
    try:
        result = run(spec)
    except Exception:  # the driver reports it as a failed cell
        result = {"status": "error: " + traceback.format_exc()[-1500:]}
    Path(spec["result_path"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
