"""open-instruct's GRPO entry point run as a user runs it, on a CPU: ``python open_instruct/grpo_fast.py ...``.

One :func:`run` is the exported checkout's own ``open_instruct/grpo_fast.py`` in a subprocess, with
open-instruct's command-line options, unpatched or patched (``grpo-patches run --frameworks
open_instruct --options ... -- python open_instruct/grpo_fast.py ...``, which sets ``GRPO_PATCHES`` and
``GRPO_PATCHES_OPTIONS`` for every process of the run). Around it, made here:

* :func:`assets`: a tiny fp32 Qwen2 and its word-level tokenizer (with a pass-through chat template),
  built in code, and a dataset folder holding ``train.jsonl`` (chat ``messages``, a digit
  ``ground_truth``, verifier ``gsm8k``; a folder, not a ``.jsonl`` path: ``_discover_tools_from_datasets``
  calls ``datasets.load_dataset`` on the raw name, which refuses a local ``.jsonl``);
* a Ray cluster of the test's own (``ray start --head``, logical GPUs: open-instruct's placement
  groups ask for one per learner and per engine), which ``main``'s ``ray.init`` attaches to through
  ``RAY_ADDRESS``;
* the start-up folder (``open_instruct_startup/``) on ``PYTHONPATH``: CPU stand-ins in every process of
  the run (``cpu_run.py``: the rollout engines, the learner on a CPU with gloo and fp32, seeded
  generators) and the records the test reads (``run_records.py``).

Comparable runs: fp32, one rollout engine answering in order with pseudo-random completions that do not
depend on the weights (identical rollouts on every run), ``--async_steps 2`` (no rollout is ever dropped
as stale within 3 steps: open-instruct drops results more than ``async_steps`` behind, and the first
weight sync after step 0 happens after step 2), SGD (``optimizer="sgd"``: AdamW built as SGD, test-only;
open-instruct has no optimizer option) at a constant learning rate, no weight decay, no warm-up.
``compile=False`` sets ``TORCHDYNAMO_DISABLE=1``: open-instruct's ``torch.compile``\\ d
``log_softmax_and_gather`` costs 30-45 s per process on this CPU and changes nothing compared between runs.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_patches_testing import entry_points
from grpo_patches_testing.nemo_rl_run_grpo import PASSTHROUGH_TEMPLATE, RayCluster

STARTUP = Path(__file__).resolve().parent / "open_instruct_startup"
REPOSITORY = Path(__file__).resolve().parents[3]  # tests/grpo-patches-testing/grpo_patches_testing/<this>
#: Ray's view of this machine for a run: the learner's placement group asks for 1 GPU + 10 CPUs per
#: learner, each engine 1 + 1, the DataPreparationActor 2 CPUs and the ActorManager 1 (logical only).
CLUSTER = {"num_cpus": 16, "num_gpus": 2}


@dataclass(frozen=True)
class Config:
    """One run's workload and open-instruct options (their names where open-instruct has them)."""

    num_unique_prompts_rollout: int = 4
    num_samples_per_prompt_rollout: int = 4
    steps: int = 3
    dataset_prompts: int = 8  # ground truths 0..7: PATTERNS by value mod 4, half the groups uniform
    max_prompt_token_length: int = 12
    response_length: int = 8
    pack_length: int = 24  # two sequences per pack, mostly of one group
    per_device_train_batch_size: int = 1
    num_mini_batches: int = 1
    num_epochs: int = 1
    beta: float = 0.0
    temperature: float = 1.0  # main's default (v0.3.0's: 0.7); the learner divides its logits by it
    deepspeed_stage: int = 2
    learning_rate: float = 0.05
    max_grad_norm: float = 1.0
    optimizer: str = "sgd"  # or "adamw": open-instruct's own
    bf16: bool = False
    seed: int = 1
    hidden: int = 64
    layers: int = 2
    compile: bool = False
    args: tuple[str, ...] = ()  # further grpo_fast.py options

    @property
    def total_episodes(self) -> int:
        return self.steps * self.num_unique_prompts_rollout * self.num_samples_per_prompt_rollout


#: The tests' run: 3 steps of 4 prompts x 4 samples, ZeRO-2, one optimizer step per step.
TESTS = Config()


def assets(root: Path, config: Config = TESTS) -> dict[str, Path]:
    """The tiny model, its tokenizer (a folder of its own: next to a Qwen2 config.json, AutoTokenizer
    would pick Qwen2's class) and the dataset folder."""
    from grpo_patches.demo import tiny_model

    model = root / f"tiny-qwen2-h{config.hidden}-l{config.layers}"
    if not (model / "config.json").exists():
        tiny_model.build_model(seed=0, hidden_size=config.hidden, num_layers=config.layers).float().save_pretrained(model)
    tokenizer = root / "tokenizer"
    if not (tokenizer / "tokenizer.json").exists():
        tok = tiny_model.build_tokenizer()
        tok.chat_template = PASSTHROUGH_TEMPLATE  # the prompt is the question (the word vocabulary has no markup)
        tok.save_pretrained(tokenizer)
    words = [w for w in tiny_model.WORDS if not w.isdigit()]
    data = root / f"prompts-{config.dataset_prompts}"
    data.mkdir(parents=True, exist_ok=True)
    rows = [{"messages": [{"role": "user", "content": " ".join(words[(7 * i + j) % len(words)] for j in range(3 + i % 3))}],
             "ground_truth": str(i % 10), "dataset": "gsm8k"} for i in range(config.dataset_prompts)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": model, "tokenizer": tokenizer, "data": data}


def arguments(config: Config, files: dict[str, Path], out: Path) -> list[str]:
    """``grpo_fast.py``'s options for ``config`` (open-instruct's own names)."""
    c = config
    return [
        "--exp_name", "e2e", "--seed", str(c.seed), "--output_dir", str(out / "output"),
        "--model_name_or_path", str(files["model"]), "--tokenizer_name_or_path", str(files["tokenizer"]),
        "--dataset_mixer_list", str(files["data"]), "1.0", "--dataset_mixer_list_splits", "train",
        "--dataset_local_cache_dir", str(out / "dataset_cache"),
        "--max_prompt_token_length", str(c.max_prompt_token_length), "--response_length", str(c.response_length),
        "--pack_length", str(c.pack_length),
        "--num_unique_prompts_rollout", str(c.num_unique_prompts_rollout),
        "--num_samples_per_prompt_rollout", str(c.num_samples_per_prompt_rollout),
        "--total_episodes", str(c.total_episodes), "--async_steps", "2", "--filter_zero_std_samples", "false",
        "--per_device_train_batch_size", str(c.per_device_train_batch_size),
        "--num_mini_batches", str(c.num_mini_batches), "--num_epochs", str(c.num_epochs),
        "--learning_rate", str(c.learning_rate), "--lr_scheduler_type", "constant", "--warmup_ratio", "0.0",
        "--weight_decay", "0.0", "--max_grad_norm", str(c.max_grad_norm), "--beta", str(c.beta),
        "--deepspeed_stage", str(c.deepspeed_stage), "--num_learners_per_node", "1", "--vllm_num_engines", "1",
        "--temperature", str(c.temperature), "--push_to_hub", "false", "--with_tracking", "false",
        "--try_auto_save_to_beaker", "false", "--save_freq", "100000",
        *c.args,
    ]


@dataclass
class Run:
    """One run of ``grpo_fast.py`` and what it left (``run_records``)."""

    returncode: int
    seconds: float
    output: str
    folder: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)  # open-instruct's logged metrics, per step
    learner: list[dict[str, Any]] = field(default_factory=list)  # per step() of the learner
    engine: list[dict[str, Any]] = field(default_factory=list)  # every rollout
    model_dir: Path | None = None  # open-instruct's final save

    def values(self, name: str) -> list[float]:
        """A logged metric, per training step."""
        return [m[name] for m in self.metrics if name in m]

    def weights(self) -> dict[str, Any]:
        """The final model as open-instruct saved it."""
        from safetensors.torch import load_file

        if self.model_dir is None:
            raise FileNotFoundError(f"{self.folder}: open-instruct saved no final model")
        out: dict[str, Any] = {}
        for path in sorted(self.model_dir.glob("*.safetensors")):
            out.update(load_file(str(path)))
        return out


def source_root() -> Path:
    """The exported checkout on ``PYTHONPATH``: ``open_instruct/`` (holding ``grpo_fast.py``) inside."""
    import importlib.util

    spec = importlib.util.find_spec("open_instruct")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("open_instruct is not importable (set OPEN_INSTRUCT_SRC; see compat/README.md)")
    return Path(list(spec.submodule_search_locations)[0]).parent


def environment(folder: Path, config: Config, cluster: RayCluster, fault: str | None = None) -> dict[str, str]:
    from grpo_patches_testing.open_instruct_cpu import environment as deepspeed_environment

    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRPO_PATCHES", "RAY_"))}
    settings = {"dump": str(folder), "seed": config.seed, "bf16": config.bf16, "optimizer": config.optimizer,
                "fault": fault}
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if fault:  # the planted fault's module (tests.helpers...) is the repository's, found last
        paths.append(str(REPOSITORY))
    env.update({
        **deepspeed_environment(), **cluster.env,
        "PYTHONPATH": os.pathsep.join([str(STARTUP), *paths]),
        "GRPO_PATCHES_OPEN_INSTRUCT_CPU": "1", "GRPO_PATCHES_OPEN_INSTRUCT_E2E": json.dumps(settings),
        "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0",
    })
    if not config.compile:
        env["TORCHDYNAMO_DISABLE"] = "1"
    return env


def run(folder: Path, cluster: RayCluster, files: dict[str, Path], config: Config = TESTS,
        options: str | None = None, timeout: float = 1800, fault: str | None = None) -> Run:
    """``python open_instruct/grpo_fast.py ...`` unpatched (``options is None``) or through
    ``grpo-patches run --frameworks open_instruct --options <options>``, in ``folder`` (its records
    and output land there). ``fault``: a planted fault entered in the learner's process (``"module:name"``
    of a context manager; ``open_instruct_startup/cpu_run.py``)."""
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [*folder.glob("*.jsonl"), folder / "output.log"]:
        stale.unlink(missing_ok=True)
    command = [sys.executable, str(source_root() / "open_instruct" / "grpo_fast.py"), *arguments(config, files, folder)]
    env = environment(folder, config, cluster, fault)
    if options is not None:  # a copy of grpo_patches in GRPO_E2E_PYTHONPATH goes first (patched runs only)
        env["PYTHONPATH"] = os.pathsep.join([*entry_points.other_package(), env["PYTHONPATH"]])
        command = entry_points.launched("open_instruct", options, folder.parent / "grpo-patches-startup", command)
    start = time.perf_counter()
    returncode, output = entry_points.run_logged(command, folder, env, timeout)
    saved = sorted(glob.glob(str(folder / "output" / "*" / "*.safetensors")))
    return Run(returncode, time.perf_counter() - start, output, folder, _lines(folder / "metrics.jsonl"),
               [x for p in sorted(folder.glob("learner-*.jsonl")) for x in _lines(p)], _lines(folder / "engine.jsonl"),
               Path(saved[0]).parent if saved else None)


def cluster() -> RayCluster:
    return RayCluster(**CLUSTER)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []

