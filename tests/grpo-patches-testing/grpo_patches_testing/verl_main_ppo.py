"""``python -m verl.trainer.main_ppo`` on CPU, as a user runs it (the end-to-end tests and ``benchmarks/fw_verl_v1.py``).

* :func:`build_assets`: a tiny Qwen2 (fp32) and a word-level tokenizer with a chat template, saved
  to a folder (no hub), a parquet dataset of prompts (half of them "equal": every sample gets the
  same reward), and the agent-loop file naming :class:`verl_main_ppo_rollout.SeededAgentLoop`;
* :class:`RayCluster`: a local Ray cluster of this test's own (its own temp dir, ports chosen by
  Ray; logical GPUs for verl's resource pools), shared by every training of a test module and
  stopped by the process that started it (never ``ray stop``);
* :func:`train`: one ``main_ppo`` run attached to that cluster (the way a user passes
  environment variables to a running cluster: ``+ray_kwargs.ray_init.runtime_env.env_vars``),
  patched with ``GRPO_PATCHES=verl`` (+ options) or not; returns verl's logged metrics per
  step, ``grpo_patches.status()`` from the worker that trained and its final weights.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

PLUGIN = "grpo_patches_testing.verl_main_ppo_plugin"
ROLLOUT_MODULE = "grpo_patches_testing.verl_main_ppo_rollout"
ROLLOUT_FILE = Path(__file__).resolve().with_name("verl_main_ppo_rollout.py")
#: A chat template for the word-level tokenizer (the agent loop builds every prompt with it).
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['content'] }}{% if not loop.last %} {% endif %}"
                 "{% endfor %}{% if add_generation_prompt %} {% endif %}")
#: Environment every process of a run needs (the cluster's and each run's).
#: ``GRPO_E2E_PYTHONPATH``: e.g. a copy of another grpo_patches version (with its ``testing``) to run these tests against.
BASE_ENV = {"VERL_USE_EXTERNAL_MODULES": PLUGIN,
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VERL_LOGGING_LEVEL": "WARN",
            "RAY_DEDUP_LOGS": "0",
            # Ray 2.60's local clusters default to token auth with a token in ~/.ray, shared by
            # every cluster of this user: the test's cluster (local, its own) goes without
            "RAY_AUTH_MODE": "disabled",
            **({"PYTHONPATH": os.environ["GRPO_E2E_PYTHONPATH"]} if os.environ.get("GRPO_E2E_PYTHONPATH") else {})}


@dataclass(frozen=True)
class Workload:
    """What one run trains: the tests' (3 optimizer steps of 4 prompts x 4 samples) by default."""

    prompts: int = 4  # per optimizer step
    samples: int = 4  # per prompt (rollout.n)
    steps: int = 3
    max_prompt: int = 16
    max_response: int = 8
    micro_rows: int = 4
    lr: float = 0.05
    hidden: int = 64
    layers: int = 2
    reward: str = f"{ROLLOUT_FILE}:compute_score"  # file:function, verl's reward.custom_reward_function


TESTS = Workload()
STEPS = TESTS.steps


@dataclass
class Assets:
    model: str
    tokenizer: str  # a folder of its own: next to a Qwen2 config.json, AutoTokenizer would pick Qwen's class
    data: str
    agent_loops: str


def build_assets(root: str | os.PathLike, workload: Workload = TESTS, prompts: list[str] | None = None,
                 ground_truths: list[str] | None = None) -> Assets:
    """The tiny model + tokenizer, the prompts and the agent-loop file under ``root``.

    Default prompts: 3..6 words, every other one ``"equal"`` (every sample the same reward)."""
    import pandas as pd

    from grpo_patches.demo import tiny_model

    root = Path(root)
    model, tokenizer = root / "tiny-qwen2", root / "tokenizer"
    if not (model / "config.json").exists():
        tiny_model.build_model(seed=0, hidden_size=workload.hidden, num_layers=workload.layers).save_pretrained(model)
        words = tiny_model.build_tokenizer()
        words.chat_template = CHAT_TEMPLATE
        words.save_pretrained(tokenizer)
    count = workload.prompts * workload.steps
    prompts = prompts or [" ".join(tiny_model.prompts(1, words_per_prompt=3 + i % 4, seed=100 + i)) for i in range(count)]
    ground_truths = ground_truths or ["equal" if i % 2 else "mixed" for i in range(count)]
    rows = [{"data_source": "grpo_e2e", "prompt": [{"role": "user", "content": text}], "ability": "none",
             "reward_model": {"style": "rule", "ground_truth": truth},
             "extra_info": {"index": i, "split": "train"}} for i, (text, truth) in enumerate(zip(prompts, ground_truths))]
    data = root / "prompts.parquet"
    pd.DataFrame(rows).to_parquet(data)
    loops = root / "agent_loops.yaml"
    loops.write_text(f"- name: grpo_e2e_seeded\n  _target_: {ROLLOUT_MODULE}.SeededAgentLoop\n")
    return Assets(str(model), str(tokenizer), str(data), str(loops))


_HOLDER = """
import sys, ray
for attempt in range(3):  # Ray waits 30 s for its raylet: a busy 2-core host can miss that
    try:
        ray.init(address="local", num_cpus=8, num_gpus=1, include_dashboard=False, _temp_dir=sys.argv[1],
                 log_to_driver=False, object_store_memory=256 * 1024 * 1024)  # "local": never another cluster
        break
    except Exception as exc:
        ray.shutdown()
        print(f"ray.init failed ({exc}); retrying", file=sys.stderr, flush=True)
else:
    sys.exit(1)
print("ADDRESS " + ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()  # until the test closes our stdin
ray.shutdown()
"""


class RayCluster:
    """A local Ray cluster owned by one holder process: closing its stdin shuts the cluster down."""

    def __init__(self, python: str = sys.executable) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="gpe2e_ray_", dir="/tmp")  # unix socket paths stay short
        env = {**os.environ, **BASE_ENV}
        for name in ("GRPO_PATCHES", "GRPO_PATCHES_OPTIONS"):
            env.pop(name, None)  # the cluster's own processes: unpatched; each run says what it wants
        self.proc = subprocess.Popen([python, "-c", _HOLDER, self.temp_dir], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if not line.startswith("ADDRESS "):
            self.proc.kill()
            raise RuntimeError(f"Ray did not start: {line}{self.proc.stderr.read()[-3000:]}")
        self.address = line.split()[1]

    def stop(self) -> None:
        """Shut the cluster down (its holder's ``ray.shutdown()``) and remove its temp dir."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@dataclass
class Run:
    """What one ``main_ppo`` run logged and left."""

    metrics: list[dict[str, float]] = field(default_factory=list)  # verl's metrics, one dict per step
    status: dict = field(default_factory=dict)  # grpo_patches.status()["verl"] from the training worker
    peak_rss_mb: float = 0.0  # the training worker's
    policy_tokens: int = 0  # token positions through the actor's forwards with gradients (the training worker's)
    policy_calls: int = 0  # those forwards (each one forward/backward micro-batch)
    weights: dict = field(default_factory=dict)  # the actor's final weights
    seconds: float = 0.0
    log: str = ""


def overrides(assets: Assets, workload: Workload, *, v1: bool, mini_batches: int, fused: bool = False) -> list[str]:
    """The ``main_ppo`` command line: GRPO, tiny model in fp32, SGD, KL loss at coefficient 0."""
    fp32 = ["param_dtype=fp32", "reduce_dtype=fp32", "buffer_dtype=fp32"]
    w = workload
    reward_file, _, reward_name = w.reward.rpartition(":")
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={assets.data}", f"data.val_files={assets.data}",
        f"data.train_batch_size={w.prompts}", f"data.max_prompt_length={w.max_prompt}",
        f"data.max_response_length={w.max_response}", "data.shuffle=False", "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={assets.model}", f"actor_rollout_ref.model.tokenizer_path={assets.tokenizer}",
        "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        f"actor_rollout_ref.model.use_fused_kernels={fused}",
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={w.prompts // mini_batches}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={w.micro_rows}",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.0",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False",
        *[f"+actor_rollout_ref.actor.fsdp_config.mixed_precision.{p}" for p in fp32],
        *[f"+actor_rollout_ref.ref.fsdp_config.mixed_precision.{p}" for p in fp32],
        "actor_rollout_ref.actor.optim.optimizer=SGD", f"actor_rollout_ref.actor.optim.lr={w.lr}",
        "actor_rollout_ref.actor.optim.weight_decay=0.0",
        "actor_rollout_ref.rollout.name=grpo_e2e_stand_in", f"actor_rollout_ref.rollout.n={w.samples}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.calculate_log_probs=False",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={w.micro_rows}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={w.micro_rows}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.agent.default_agent_loop=grpo_e2e_seeded",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={assets.agent_loops}",
        "reward.num_workers=1", f"reward.custom_reward_function.path={reward_file}",
        f"reward.custom_reward_function.name={reward_name}",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        f"trainer.use_v1={v1}",
        f"trainer.v1.sampler.custom_sampler.path={ROLLOUT_FILE}",
        "trainer.v1.sampler.custom_sampler.name=OrderedReplayBuffer",
        "trainer.n_gpus_per_node=1", "trainer.nnodes=1", "trainer.device=cpu",
        "trainer.logger=[console,file]", "trainer.val_before_train=False", "trainer.test_freq=-1",
        "trainer.save_freq=-1", f"trainer.total_training_steps={w.steps}", "trainer.total_epochs=1",
        "trainer.project_name=grpo_e2e", "trainer.experiment_name=run",
    ]


def train(assets: Assets, cluster: RayCluster, out: str | os.PathLike, *, v1: bool, mini_batches: int,
          patches: dict[str, str] | None, fused: bool = False, workload: Workload = TESTS,
          python: str = sys.executable, timeout: int = 900) -> Run:
    """One ``main_ppo`` run on ``cluster``; ``patches``: ``None`` (unpatched) or the
    ``GRPO_PATCHES_OPTIONS`` of a ``GRPO_PATCHES=verl`` run (``{}``: the defaults)."""
    out = Path(out)
    shutil.rmtree(out, ignore_errors=True)  # a run reads back only what it wrote
    out.mkdir(parents=True)
    run_env = {"GRPO_E2E_OUT": str(out), "VERL_FILE_LOGGER_PATH": str(out / "metrics.jsonl"),
               "OMP_NUM_THREADS": "1"}
    if patches is not None:
        run_env["GRPO_PATCHES"] = "verl"
        run_env["GRPO_PATCHES_OPTIONS"] = ",".join(f"{k}={v}" for k, v in patches.items())
    ray_env = [f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}='{v}'" for k, v in {**BASE_ENV, **run_env}.items()]
    command = [python, "-m", "verl.trainer.main_ppo",
               *overrides(assets, workload, v1=v1, mini_batches=mini_batches, fused=fused),
               f"+ray_kwargs.ray_init.address={cluster.address}", *ray_env, f"hydra.run.dir={out / 'hydra'}"]
    env = {k: v for k, v in os.environ.items() if k not in ("GRPO_PATCHES", "GRPO_PATCHES_OPTIONS")}
    env.update(BASE_ENV, **run_env)
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, cwd=out, capture_output=True, text=True, timeout=timeout)
    run = Run(seconds=time.perf_counter() - start, log=proc.stdout[-20000:] + proc.stderr[-20000:])
    if proc.returncode != 0:
        raise RuntimeError(f"main_ppo failed (exit {proc.returncode}):\n{run.log[-8000:]}")
    run.metrics = [json.loads(line)["data"] for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    statuses = sorted(glob.glob(str(out / "worker-*.json")))
    weights = sorted(glob.glob(str(out / "weights-*.pt")))
    if len(statuses) != 1 or len(weights) != 1:
        raise RuntimeError(f"expected one training worker's status and weights in {out}: {statuses} {weights}")
    report = json.loads(Path(statuses[0]).read_text())
    run.status, run.peak_rss_mb, run.policy_tokens = report["status"], report["peak_rss_mb"], report["policy_tokens"]
    run.policy_calls = report.get("policy_calls", 0)
    import torch

    run.weights = torch.load(weights[0])
    return run
