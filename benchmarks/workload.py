"""The one GRPO workload that ``benchmarks/frameworks.py`` runs through every framework.

Same tiny model family (``grpo_patches.demo.tiny_model``: a Qwen2 built from a config, word-level
tokenizer, fixed seed), same prompts, same reward, same rows per optimizer step, plain SGD
(AdamW turns rounding noise into lr-sized steps and would hide whether the patched run is
exact). The reward is constant within the groups of ``saturated`` prompts (every completion
gets the same reward, so the group's advantages are exactly 0 in every framework's GRPO
estimator) and varies with the completion elsewhere: with the default 6 of 8 prompts
saturated, ~75 % of the rows have zero advantage, as late in a GRPO run when most prompts are
solved (or hopeless). Framework-free: no torch or framework import at module level.
"""

from __future__ import annotations

from typing import Any

#: The workload (the README numbers); ``QUICK`` overrides it for a smoke run.
SPEC: dict[str, Any] = {
    "hidden": 256,  # tiny_model width / depth: big enough that the passes saved show over per-call overhead
    "layers": 4,
    "prompts": 8,  # prompts per optimizer step
    "generations": 8,  # completions per prompt: 64 rows per optimizer step
    "micro_rows": 16,  # rows per micro-batch (forward/backward call)
    "completion_tokens": 32,
    "saturated": 6,  # prompts whose every completion gets the same reward: 6/8 = 75 % zero-advantage rows
    "steps": 6,  # optimizer steps per run
    "warmup": 1,  # first steps left out of the per-step medians (first-call costs)
    "lr": 1e-2,
    "seed": 0,
    "threads": 2,
}
QUICK: dict[str, Any] = {"hidden": 64, "layers": 2, "completion_tokens": 12, "steps": 3}


def prompt_texts(spec: dict[str, Any]) -> list[str]:
    """The prompts, in a fixed order (the first ``saturated`` of them have a constant reward)."""
    from grpo_patches.demo import tiny_model

    return tiny_model.prompts(spec["prompts"], words_per_prompt=4, seed=spec["seed"])


def _char_sum(text: str) -> int:
    return sum(ord(c) for c in text)


def reward(spec: dict[str, Any], prompt: str, completion: str) -> float:
    """Constant per saturated prompt (a small integer, so every framework's group mean is exact
    and the advantage exactly 0), the completion's character-sum hash elsewhere."""
    texts = prompt_texts(spec)
    index = texts.index(prompt.strip()) if prompt.strip() in texts else len(texts)
    if index < spec["saturated"]:
        return float(index % 5)
    return (_char_sum(completion) % 97) / 97.0


def zero_share(spec: dict[str, Any]) -> float:
    """The share of rows whose advantage the reward makes exactly 0."""
    return spec["saturated"] / spec["prompts"]


def describe(spec: dict[str, Any]) -> str:
    return (f"tiny Qwen2 h{spec['hidden']} x{spec['layers']}, {spec['prompts']} prompts x {spec['generations']} "
            f"completions of <= {spec['completion_tokens']} tokens per optimizer step, micro-batches of "
            f"{spec['micro_rows']} rows, {zero_share(spec):.0%} zero-advantage rows, SGD lr {spec['lr']}, "
            f"{spec['steps']} steps (first {spec['warmup']} untimed), CPU fp32, {spec['threads']} threads")
