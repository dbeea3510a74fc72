"""The CPU stand-in for open-instruct's vLLM engine actor and vLLM's weight transfer (tests only).

open-instruct's driver builds its rollout engines with ``vllm_utils.create_vllm_engines``: one Ray actor
of class ``vllm_utils.LLMRayActor`` per engine, which starts vLLM's ``AsyncLLMEngine`` and its OpenAI
server on a GPU. :class:`CpuEngine` takes that class's place (``create_vllm_engines`` itself runs
unchanged: placement group, options, arguments) and answers what its callers use:

* the rollout loop: it pulls ``PromptRequest``\\ s from ``prompt_queue`` one at a time, in order, and puts
  one ``GenerationResult`` per prompt on ``results_queue`` (``eval_results_queue`` for evaluation
  prompts), built and rewarded by open-instruct's own ``process_completed_request`` and
  ``compute_rewards`` (its verifiers);
* the completions do not depend on the weights: pseudo-random words seeded by (the run's seed, the
  prompt's id -- its epoch and dataset index, so each step's prompts get their own --, the sample),
  then a digit answer and ``<eos>``. The answer is the row's ground truth or a wrong digit by the
  ground truth's value (:data:`PATTERNS`: every sample right, every other one, none), so groups are
  mixed or uniform (advantage exactly 0). One engine answering in order makes every run see the same
  rollouts in the same order. Log-probs are the sampler's own: ``-log(words)`` for a drawn word, 0 for
  the forced answer and ``<eos>``;
* weight sync (``init_weight_transfer_engine``, ``update_weights``, ``sleep``, ``wake_up``,
  ``set_model_step``), ``ready``, ``get_kv_cache_info``, ``check_background_threads``: answered
  without a model (the model step is kept, as vLLM's actor keeps it).

vLLM's weight-transfer API that the learner calls (``NCCLWeightTransferEngine.trainer_init`` /
``trainer_send_weights``, ``WeightTransferInitRequest``, ...) gets CPU stand-ins in the ``vllm``
import stand-in (:func:`install_vllm_names`): the learner still gathers and clones every parameter
as upstream does; the stand-in consumes them and records a fingerprint per sync (no NCCL).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import random
import threading
import time
import traceback
from types import SimpleNamespace
from typing import Any

#: How many of a prompt's samples end with the right answer, by its ground truth's value (mod 4).
PATTERNS = ("all", "even", "none", "even")


def right_answer(pattern: str, sample: int) -> bool:
    return {"all": True, "none": False, "even": sample % 2 == 0}[pattern]


# ---------------------------------------------------------------- vLLM's weight-transfer API (learner side)


@dataclasses.dataclass
class WeightTransferConfig:
    backend: str = "nccl"


@dataclasses.dataclass
class WeightTransferInitRequest:
    init_info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class WeightTransferUpdateRequest:
    update_info: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class NCCLTrainerSendWeightsArgs:
    group: Any = None
    packed: bool = False


#: Fingerprints of the weights each sync sent, in this process (read by ``run_records``).
SENT: list[dict[str, float]] = []


class NCCLWeightTransferEngine:
    """vLLM's trainer side of the NCCL weight transfer, on a CPU: no group, the weights consumed."""

    @staticmethod
    def trainer_init(master_info: dict) -> dict:
        return {"master_info": master_info, "stand_in": "grpo_patches_testing (CPU, no NCCL)"}

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any = None) -> None:
        total = squares = 0.0
        count = 0
        for _name, tensor in iterator:
            t = tensor.detach().double()
            total += float(t.sum())
            squares += float(t.square().sum())
            count += 1
        SENT.append({"tensors": count, "sum": total, "sum_sq": squares})


def install_vllm_names() -> None:
    """Put the stand-ins above where open-instruct imports them from (the ``vllm`` import stand-in,
    :mod:`grpo_patches_testing.open_instruct_vllm`, must be installed: every other name stays a
    dummy that raises when used)."""
    import importlib

    names = {"vllm.config": [WeightTransferConfig],
             "vllm.distributed.weight_transfer.base": [WeightTransferInitRequest, WeightTransferUpdateRequest],
             "vllm.distributed.weight_transfer.nccl_engine": [NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine]}
    for module_name, classes in names.items():
        module = importlib.import_module(module_name)
        for cls in classes:
            setattr(module, cls.__name__, cls)


# ---------------------------------------------------------------- the engine actor


class CpuEngine:
    """Stands where ``create_vllm_engines`` builds ``LLMRayActor`` (same constructor arguments)."""

    def __init__(self, *args: Any, prompt_queue: Any, results_queue: Any, eval_results_queue: Any,
                 actor_manager: Any = None, reward_config: Any = None, train_dataset: Any = None,
                 eval_dataset: Any = None, **kwargs: Any) -> None:
        from transformers import AutoTokenizer

        self.model = kwargs.get("model")
        self.tokenizer = AutoTokenizer.from_pretrained(kwargs.get("tokenizer") or self.model)
        self.llm_engine = SimpleNamespace(tokenizer=self.tokenizer)  # what vllm_utils.compute_rewards reads
        self.reward_fn = reward_config.build() if reward_config else None
        self.prompt_queue, self.results_queue, self.eval_results_queue = prompt_queue, results_queue, eval_results_queue
        self.actor_manager = actor_manager
        self.datasets = {False: train_dataset, True: eval_dataset}
        self.index_maps = {flag: ({ds[i]["index"]: i for i in range(len(ds))} if ds is not None else {})
                           for flag, ds in self.datasets.items()}
        vocab = self.tokenizer.get_vocab()
        self.words = sorted((w for w in vocab if w.isalpha()), key=vocab.__getitem__)  # no digits, no specials
        self.current_model_step = 0
        self.syncs: list[dict[str, Any]] = []
        self._error: str | None = None
        self._thread = threading.Thread(target=self._serve, name="cpu-engine", daemon=True)
        self._thread.start()

    # -- what LLMRayActor's callers use

    def ready(self) -> bool:
        return True

    def get_kv_cache_info(self) -> int:
        return 1 << 16  # no KV cache: never the bottleneck

    def get_model_dims(self) -> Any:
        from open_instruct import utils

        return utils.ModelDims.from_hf_config(self.model)

    def init_weight_transfer_engine(self, request: Any) -> None:
        self.syncs.append({"init": dataclasses.asdict(request) if dataclasses.is_dataclass(request) else str(request)})

    def update_weights(self, update_info: dict, model_step: int | None = None) -> None:
        info = update_info.get("update_info", update_info)
        self.syncs.append({"update": len(info.get("names", ())), "model_step": model_step})
        if model_step is not None:
            self.current_model_step = model_step

    def set_model_step(self, model_step: int) -> None:
        self.current_model_step = model_step

    def sleep(self) -> None:
        return None

    def wake_up(self) -> None:
        return None

    def reset_prefix_cache(self) -> None:
        return None

    def check_background_threads(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the CPU stand-in engine's thread failed:\n{self._error}")
        if not self._thread.is_alive():
            raise RuntimeError("the CPU stand-in engine's thread has died")

    # -- the rollouts

    def _serve(self) -> None:
        import ray

        try:
            while True:
                self._answer(self.prompt_queue.get())
        except ray.exceptions.RayActorError:  # the driver's clean-up killed the queue: the run is over
            return
        except BaseException:  # noqa: BLE001 - reported by check_background_threads
            self._error = traceback.format_exc()

    def _lookup(self, index: int, is_eval: bool) -> dict:
        return dict(self.datasets[is_eval][self.index_maps[is_eval][index]])

    def completion(self, prompt_id: str, sample: int, ground_truth: str, seed: int | None,
                   max_tokens: int) -> tuple[list[int], list[float]]:
        """Token ids and the sampler's log-probs of one sample (the same on every run)."""
        if not ground_truth.isdigit():
            raise ValueError(f"the CPU stand-in engine answers digit ground truths only (got {ground_truth!r})")
        rng = random.Random(f"{seed}/{prompt_id}/{sample}")
        words = [rng.choice(self.words) for _ in range(rng.randint(1, max(1, max_tokens - 2)))]
        answer = ground_truth if right_answer(PATTERNS[int(ground_truth) % 4], sample) else str((int(ground_truth) + 1) % 10)
        ids = self.tokenizer.convert_tokens_to_ids([*words, answer]) + [self.tokenizer.eos_token_id]
        return ids, [-math.log(len(self.words))] * len(words) + [0.0, 0.0]

    def _answer(self, request: Any) -> None:
        from open_instruct import vllm_utils
        from open_instruct.dataset_transformation import GROUND_TRUTHS_KEY

        start = time.perf_counter()
        request_id = vllm_utils.make_request_id(request)
        example = self._lookup(request.index, request.is_eval)
        truth = example[GROUND_TRUTHS_KEY]
        truth = str(truth[0] if isinstance(truth, list) else truth)
        config = request.generation_config
        outs = []
        for j in range(config.n):
            ids, logprobs = self.completion(request.prompt_id, j, truth, config.seed, config.max_tokens)
            done = vllm_utils.CompletionOutput(index=j, token_ids=ids, logprobs=logprobs, finish_reason="stop",
                                               cumulative_logprob=sum(logprobs), mask=[1] * len(ids))
            outs.append(vllm_utils.RequestOutput(request_id=f"{request_id}_{j}", prompt_token_ids=list(request.prompt),
                                                 outputs=[done]))
        metadata = {request_id: {"is_eval": request.is_eval, "index": request.index, "prompt_id": request.prompt_id,
                                 "model_step": self.current_model_step, "prompt_token_ids": list(request.prompt),
                                 "start_time": start, "ground_truth": request.ground_truth}}
        result, is_eval, example = vllm_utils.process_completed_request(
            request_id, outs, time.perf_counter(), False, metadata, dataset_lookup=self._lookup)
        result.reward_scores, result.reward_metrics = asyncio.run(vllm_utils.compute_rewards(self, result, example))
        _record({"prompt_id": request.prompt_id, "index": request.index, "eval": is_eval,
                 "model_step": result.model_step, "responses": result.responses, "scores": result.reward_scores})
        (self.eval_results_queue if is_eval else self.results_queue).put(result)


def _record(line: dict[str, Any]) -> None:
    from grpo_patches_testing.open_instruct_startup import cpu_run

    dump = cpu_run.settings().get("dump")
    if dump:
        with open(os.path.join(dump, "engine.jsonl"), "a") as f:
            f.write(json.dumps(line, default=float) + "\n")
