"""The one GRPO workload that ``benchmarks/frameworks.py`` runs through every framework.

Same tiny model family (``grpo_patches.demo.tiny_model``: a Qwen2 built from a config, word-level
tokenizer, fixed seed), same prompts, same reward, same rows per optimizer step, plain SGD
(AdamW turns rounding noise into lr-sized steps and would hide whether the patched run is
exact). The reward is constant within the groups of ``saturated`` prompts (every completion
gets the same reward, so the group's advantages are exactly 0 in every framework's GRPO
estimator) and varies with the completion elsewhere: with the default 6 of 8 prompts
saturated, ~75 % of the rows have zero advantage, as late in a GRPO run when most prompts are
solved (or hopeless). Framework-free: no torch or framework import at module level.

Two knobs of ``frameworks.py`` change the workload (both off in the main table of benchmarks/RESULTS.md):

* ``mini_batches`` (``--mini-batches N``): each rollout batch is consumed by N optimizer steps
  (TRL: ``steps_per_generation`` micro-batches per generation, ``gradient_accumulation_steps``
  = 1/N of them; verl: ``ppo_mini_batch_size`` = batch / N; NeMo-RL:
  ``train_global_batch_size`` = rollout / N), so the frameworks compute old log-probs; ``steps``
  stays the number of rollout batches, timings are per rollout batch.
* ``variable_lengths`` (``--variable-lengths``): prompts of 2-8 words (:func:`prompt_words`) and
  a tiny model whose ``<eos>`` is boosted (:data:`EOS_BOOST`), so completions end at varied
  lengths: the padding the kept rows need not compute.
"""

from __future__ import annotations

from typing import Any

#: The workload (the runs in benchmarks/RESULTS.md); ``QUICK`` overrides it for a smoke run.
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
    "mini_batches": 1,  # optimizer steps per rollout batch
    "variable_lengths": False,  # varied prompt words and early <eos> (module docstring)
}
#: ``tiny_model.build_model(eos_boost=...)`` with ``variable_lengths``: completions of 1 to the
#: maximum tokens, ~40 % at the maximum (HF sampling from the initial weights: mean 16.5 of 32 at
#: h256 x4, 6.9 of 12 at the quick run's h64 x2).
EOS_BOOST = 20.0
QUICK: dict[str, Any] = {"hidden": 64, "layers": 2, "completion_tokens": 12, "steps": 3}


def prompt_texts(spec: dict[str, Any]) -> list[str]:
    """The prompts, in a fixed order (the first ``saturated`` of them have a constant reward)."""
    from grpo_patches.demo import tiny_model

    if not spec.get("variable_lengths"):
        return tiny_model.prompts(spec["prompts"], words_per_prompt=4, seed=spec["seed"])
    return [tiny_model.prompts(1, words_per_prompt=prompt_words(i), seed=spec["seed"] * 100 + i)[0]
            for i in range(spec["prompts"])]


def prompt_words(index: int) -> int:
    """Words of prompt ``index`` with ``variable_lengths``: 2-8, in no order tied to the reward."""
    return 2 + (5 * index) % 7


def eos_boost(spec: dict[str, Any]) -> float:
    """The tiny model's ``eos_boost`` for ``spec`` (1.0: the unchanged random init)."""
    return EOS_BOOST if spec.get("variable_lengths") else 1.0


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
    batches = spec.get("mini_batches", 1)
    per = "optimizer step" if batches == 1 else f"rollout batch ({batches} mini-batches: {batches} optimizer steps)"
    lengths = ", prompts of 2-8 words and early <eos> (varied lengths)" if spec.get("variable_lengths") else ""
    return (f"tiny Qwen2 h{spec['hidden']} x{spec['layers']}, {spec['prompts']} prompts x {spec['generations']} "
            f"completions of <= {spec['completion_tokens']} tokens per {per}{lengths}, micro-batches of "
            f"{spec['micro_rows']} rows, {zero_share(spec):.0%} zero-advantage rows, SGD lr {spec['lr']}, "
            f"{spec['steps']} {'steps' if batches == 1 else 'rollout batches'} (first {spec['warmup']} untimed), "
            f"CPU fp32, {spec['threads']} threads")
