"""The CPU stand-in for verl's rollout in the end-to-end runs (``grpo_patches_testing``; verl 0.9 engine line).

No rollout backend of verl runs on CPU (vLLM / SGLang / TensorRT-LLM servers only), so the
end-to-end runs plug a stand-in into verl's own extension points. :mod:`verl_main_ppo_plugin`
registers the first two by name in every process; verl imports this module when it uses them
(never while ``verl`` itself is being imported):

* :class:`StandInReplica` (``RolloutReplicaRegistry``): one :class:`StandInServer` actor per
  replica, the "LLM server" verl's agent loops ask for tokens;
* :class:`StandInRollout` (``_ROLLOUT_REGISTRY``): the worker-side adapter verl syncs weights
  into after every step: nothing to sync, the completions never depend on the weights;
* :class:`SeededAgentLoop` (``rollout.agent.agent_loop_config_path``): verl's single-turn agent
  loop with a seed per (step, prompt, sample) in each request, so patched and unpatched runs
  see the same completions at every step (legacy and V1 trainers alike);
* :class:`OrderedReplayBuffer` (``trainer.v1.sampler.custom_sampler``): the V1 trainer orders a
  batch by rollout completion, which changes from run to run; this orders it by (prompt, sample);
* :func:`compute_score` (``reward.custom_reward_function``): half the prompts give every sample
  the same reward (exactly zero advantage), the other half a reward that varies per sample.
"""

from __future__ import annotations

import hashlib
import random
import uuid
from typing import Any

import ray
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

#: The rollout name (``actor_rollout_ref.rollout.name``) the plugin registers.
NAME = "grpo_e2e_stand_in"
#: Completion tokens are word ids (after the 4 special tokens of grpo_patches.demo.tiny_model).
FIRST_WORD_ID = 4


def seed_of(*parts: Any) -> int:
    """A seed that is the same in every process and run (``hash()`` of a str is salted per process)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


def completion(seed: int, vocab_size: int, max_tokens: int) -> list[int]:
    """2..max_tokens pseudo-random word ids, from ``seed`` alone."""
    rng = random.Random(seed)
    return [rng.randrange(FIRST_WORD_ID, vocab_size) for _ in range(rng.randint(2, max_tokens))]


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **_: Any) -> float:
    """``"equal"`` prompts: 0.5 for every sample (the group's advantages are exactly 0);
    ``"mixed"``: 1.0 when the completion's first word sorts before "m", else 0.0."""
    if ground_truth == "equal":
        return 0.5
    words = solution_str.split()
    return 1.0 if words and words[0] < "m" else 0.0


@ray.remote(num_cpus=0)
class StandInServer:
    """Answers the agent loop's ``generate`` with pseudo-random tokens; every control call is a no-op."""

    def __init__(self, vocab_size: int, max_tokens: int):
        self.vocab_size, self.max_tokens = vocab_size, max_tokens

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict, **_: Any) -> TokenOutput:
        seed = sampling_params.get("seed")
        if seed is None:
            raise RuntimeError(f"{NAME}: a request without a seed (the runs use SeededAgentLoop)")
        tokens = completion(int(seed), self.vocab_size, self.max_tokens)
        # the weight version verl's off-policy metrics read (a sync trainer generates step s with step s-1's)
        version = int(sampling_params.get("weight_version", 0))
        return TokenOutput(token_ids=tokens, stop_reason="completed", extra_fields={"global_steps": version})

    async def _noop(self, *args: Any, **kwargs: Any) -> None:
        return None

    wake_up = sleep = clear_kv_cache = abort_all_requests = resume_generation = _noop
    release_kv_cache = resume_kv_cache = start_profile = stop_profile = _noop


class StandInReplica(RolloutReplica):
    """A rollout replica whose server is one :class:`StandInServer` (no GPU, no engine)."""

    async def launch_servers(self) -> None:
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(self.model_config.path).vocab_size
        name = f"{NAME}_{self.replica_rank}_{uuid.uuid4().hex[:8]}"
        server = StandInServer.options(name=name).remote(vocab, self.config.response_length)
        self.servers = [server]
        self._server_handle = server
        self._server_address = name

    def rollout_worker_use_gpu(self) -> bool:
        return False


class StandInRollout(BaseRollout):
    """The worker-side rollout: verl's naive weight sync calls it every step; nothing to sync."""

    async def resume(self, tags: list[str]) -> None:
        return None

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any) -> None:
        return None  # the completions never depend on the weights

    async def release(self) -> None:
        return None


class SeededAgentLoop(SingleTurnAgentLoop):
    """verl's single-turn agent loop; each request carries a seed from (prompt index, sample).

    Every prompt of the test data is drawn at one step only, so its dataset index stands for
    (step, prompt). The V1 trainer names the sample (``session_id``); the legacy one repeats each
    prompt ``rollout.n`` times in a row and starts the loops in that order (asyncio runs tasks in
    creation order up to their first ``await``), so the n-th call for an index is sample n.
    The prompt tokens come from verl's generic Continuous Token builder: the Qwen one (picked from
    the model type) expects Qwen's own tokenizer, not the word-level one of these runs."""

    calls: dict[int, int] = {}  # prompt index -> loops started for it in this process (legacy trainer)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if "hf_model_type" in kwargs:
            kwargs["hf_model_type"] = None
        super().__init__(*args, **kwargs)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        index = int(kwargs["index"])
        if "session_id" in kwargs:
            sample = int(kwargs["session_id"])
        else:
            sample = self.calls.get(index, 0)
            self.calls[index] = sample + 1
        version = int(kwargs.get("global_steps", 1)) - 1
        return await super().run({**sampling_params, "seed": seed_of(index, sample), "weight_version": version},
                                 **kwargs)


def _values(field: Any) -> list:
    return field.tolist() if hasattr(field, "tolist") else [getattr(v, "data", v) for v in field]


try:
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer
except ImportError:  # no V1 trainer (before 0.9)
    ReplayBuffer = object


class OrderedReplayBuffer(ReplayBuffer):
    """verl's V1 replay buffer, each batch ordered by (prompt index, sample) instead of completion order."""

    def _materialize_batch(self, partition_id: str, selected_prompt_uids: list[str], partition_snapshot: dict) -> Any:
        import transfer_queue as tq

        batch = super()._materialize_batch(partition_id, selected_prompt_uids, partition_snapshot)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=partition_id, select_fields=["index"])
        index = [int(i) for i in _values(data["index"])]
        sample = [tuple(int(p) for p in key.split("_")[1:]) for key in batch.keys]  # {uid}_{session}_{output}
        batch.reorder(sorted(range(len(batch.keys)), key=lambda i: (index[i], sample[i])))
        return batch
