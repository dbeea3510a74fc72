"""Deterministic rollouts for open-instruct's learner, packed and collated by its own code.

A "rollout" here is what open-instruct's vLLM engines hand its ``DataPreparationActor``: per prompt
``samples_per_prompt`` responses with their vLLM log-probs and a verifiable score per response.
:func:`rollouts` makes them from a seed (prompts and responses are random words of the tiny
vocabulary; the log-probs are the tiny model's own at its initial weights, as an engine holding
those weights would report; some groups get one score for every response, i.e. zero std).

:func:`collated` then does what ``DataPreparationActor._data_preparation_loop`` does with them
(``open_instruct/data_loader.py``): drop zero-std groups when ``filter_zero_std_samples`` (as
``accumulate_inference_batches`` does), advantages per response (``centered``: score minus the
group mean; ``standard``: divided by the group std + 1e-8), then open-instruct's own
``rl_utils.pack_sequences``, the per-token advantage gather through the packed response masks,
and its own ``prepare_collated_data_for_workers`` (one ``CollatedBatchData`` per DP rank).
Those few inline lines of the loop are the only open-instruct logic repeated here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Token ids the rollouts never use (the tiny tokenizer's specials: pad 0, eos 1, unk 2, bos 3).
FIRST_WORD = 4


@dataclass(frozen=True)
class Rollouts:
    """One training step's generations, in the layout open-instruct's data preparation reads."""

    queries: list[list[int]]
    responses: list[list[int]]
    masks: list[list[int]]  # tool masks (1: a model token)
    logprobs: list[list[float]]  # the engine's log-prob of each response token
    scores: list[float]  # one per response
    samples_per_prompt: int


def rollouts(model_path: str, *, prompts: int, samples_per_prompt: int, zero_std_groups: int | tuple[int, ...], seed: int,
             max_query: int = 6, max_response: int = 8, temperature: float = 1.0) -> Rollouts:
    """``prompts`` groups of ``samples_per_prompt`` responses; the first ``zero_std_groups`` groups (or, a
    tuple, those groups: open-instruct's collation gives each data-parallel rank a contiguous share)
    get one score for all their responses (an exactly zero advantage), the others two different
    scores (0 or 10, open-instruct's verifiable reward) so their std is not zero."""
    import numpy as np
    import torch
    import transformers

    rng = np.random.default_rng(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    queries, responses, scores = [], [], []
    zero = set(range(zero_std_groups)) if isinstance(zero_std_groups, int) else set(zero_std_groups)
    for group in range(prompts):
        query = rng.integers(FIRST_WORD, vocab, size=int(rng.integers(3, max_query + 1))).tolist()
        if group in zero:
            group_scores = [float(rng.choice([0.0, 10.0]))] * samples_per_prompt
        else:
            group_scores = [10.0 * (i % 2) for i in range(samples_per_prompt)]
            rng.shuffle(group_scores)
        for score in group_scores:
            queries.append(query)
            responses.append(rng.integers(FIRST_WORD, vocab, size=int(rng.integers(2, max_response + 1))).tolist())
            scores.append(float(score))
    logprobs = []
    with torch.no_grad():
        for query, response in zip(queries, responses):
            ids = torch.tensor([query + response])
            logits = model(input_ids=ids).logits[0, len(query) - 1:-1] / temperature
            lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
            logprobs.append(lp.tolist())
    return Rollouts(queries, responses, [[1] * len(r) for r in responses], logprobs, scores, samples_per_prompt)


def advantages(scores: list[float], samples_per_prompt: int, normalization: str = "centered") -> Any:
    """Per-response advantages as ``DataPreparationActor._data_preparation_loop`` computes them."""
    import numpy as np

    scores_np = np.array(scores)
    per_prompt = scores_np.reshape(-1, samples_per_prompt)
    mean = np.repeat(per_prompt.mean(axis=-1), samples_per_prompt, axis=0)
    std = np.repeat(per_prompt.std(axis=-1), samples_per_prompt, axis=0)
    if normalization == "standard":
        return (scores_np - mean) / (std + 1e-8)
    if normalization == "centered":
        return scores_np - mean
    raise ValueError(f"Invalid advantage normalization type: {normalization}")


def keep_nonzero_std(r: Rollouts) -> Rollouts:
    """The groups ``accumulate_inference_batches`` keeps under ``filter_zero_std_samples=True``
    (``np.std(result.reward_scores) == 0`` drops a group)."""
    import numpy as np

    n = r.samples_per_prompt
    keep = [i for g in range(len(r.scores) // n) if np.std(r.scores[g * n:(g + 1) * n]) != 0
            for i in range(g * n, (g + 1) * n)]
    pick = lambda xs: [xs[i] for i in keep]  # noqa: E731
    return Rollouts(pick(r.queries), pick(r.responses), pick(r.masks), pick(r.logprobs), pick(r.scores), n)


def collated(r: Rollouts, *, pack_length: int, dp_world_size: int, per_device_train_batch_size: int,
             pad_token_id: int, filter_zero_std_samples: bool, seed: int,
             normalization: str = "centered") -> list[Any]:
    """One ``CollatedBatchData`` per DP rank, through open-instruct's own packing and collation."""
    import numpy as np
    import torch
    from open_instruct.data_loader import prepare_collated_data_for_workers
    from open_instruct.rl_utils import pack_sequences

    if filter_zero_std_samples:
        r = keep_nonzero_std(r)
    adv = advantages(r.scores, r.samples_per_prompt, normalization)
    packed = pack_sequences(queries=r.queries, responses=r.responses, masks=r.masks, pack_length=pack_length,
                            pad_token_id=pad_token_id, vllm_logprobs=r.logprobs, min_num_batches=dp_world_size,
                            mask_tool_use=True)
    lookup = np.zeros(len(adv) + 1, dtype=np.float32)
    lookup[1:] = adv
    packed.advantages = [torch.tensor(lookup[mask], dtype=torch.float32) for mask in packed.response_masks]
    packed.response_masks = [mask.bool() for mask in packed.response_masks]
    state = np.random.get_state()
    np.random.seed(seed)  # prepare_collated_data_for_workers shuffles each rank's rows with np.random
    try:
        return prepare_collated_data_for_workers(packed, dp_world_size, per_device_train_batch_size, pad_token_id,
                                                 pin_memory=False)
    finally:
        np.random.set_state(state)
