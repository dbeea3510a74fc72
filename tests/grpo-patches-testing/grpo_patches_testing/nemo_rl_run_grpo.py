"""NeMo-RL's GRPO entry point run as a user runs it, on a CPU, for the end-to-end cells.

One :class:`Run` is ``examples/run_grpo.py`` from the tag's source export, started with its
example config and command-line overrides, unpatched (``python examples/run_grpo.py ...``) or
patched (``grpo-patches run --frameworks nemo_rl --options ... -- python examples/run_grpo.py
...``, as the README says). Around it, made here:

* :class:`RayCluster`: a local Ray head of this test only (``ray start --head --block``, its own
  temp dir and explicit free ports, one logical GPU), stopped through its process group; the
  driver attaches by explicit address (``RAY_ADDRESS``: NeMo-RL's ``init_ray`` asks for
  ``address="auto"``, which Ray resolves from that variable first);
* :func:`worker_venv`: the DTensor policy worker's venv where NeMo-RL looks it up
  (``$NEMO_RL_VENV_DIR/<actor class fqn>/bin/python``, reused when present: no uv, no network).
  It sees this environment's packages except grpo_patches, which reaches the worker only through
  the start-up directory on ``PYTHONPATH``;
* :func:`assets`: a tiny fp32 Qwen2 and word-level tokenizer built in code
  (:mod:`grpo_patches.demo.tiny_model`) and a 12-prompt math data file whose rows say which samples
  the generation stand-in answers right (``nemo_rl_startup/nemo_e2e_cpu.py``);
* what a run leaves: NeMo-RL's tensorboard scalars (its own logged metrics), the worker's
  per-call records and weights, the driver's ``status()``.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_patches_testing import entry_points

STARTUP = Path(__file__).resolve().parent / "nemo_rl_startup"
WORKER_FQN = "nemo_rl.models.policy.workers.dtensor_policy_worker_v2.DTensorPolicyWorkerV2"
PASSTHROUGH_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


@dataclass(frozen=True)
class Shape:
    """What a run trains: rollout and batch sizes, the tiny model, the stand-in's answers.

    ``patterns`` says, per prompt (cycled), which samples the generation stand-in answers
    right: ``all`` / ``none`` (a uniform group: advantage exactly 0) or ``even``. Completions are
    ``filler`` words (``None``: 1-3 by sample) then the answer digit.
    """

    prompts_per_step: int = 4
    samples: int = 4
    steps: int = 3
    micro_batch: int = 8  # two prompt groups a micro-batch: the filter packs kept rows of different ones together
    lr: float = 0.5
    patterns: tuple[str, ...] = ("all", "even", "none", "even")  # half the rows at advantage 0
    distinct_prompts: int | None = None  # None: new prompts every step; else these, repeated
    filler: int | None = None
    max_length: int = 32
    hidden: int = 64
    layers: int = 2
    seed: int = 0

    @property
    def rows(self) -> int:
        return self.prompts_per_step * self.samples

    @property
    def zero_rows(self) -> int:
        """Rows per step whose advantage is exactly 0 (the uniform groups)."""
        patterns = [self.patterns[i % len(self.patterns)] for i in range(self.prompts_per_step)]
        return self.samples * sum(p in ("all", "none") for p in patterns)


#: The end-to-end cells' shape: 3 steps of 4 prompts x 4 samples, half the rows at advantage 0.
CELL = Shape()


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports: all bound at once (one at a time, the OS may give one twice)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def _free_range(size: int = 100, avoid: tuple[int, ...] = ()) -> int:
    """The first port of ``size`` consecutive free ports (Ray's worker port range), none in ``avoid``."""
    import random

    for _ in range(50):
        start = random.randrange(40000, 59000)
        ok = not any(start <= port < start + size for port in avoid)
        for port in range(start, start + size):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return start
    raise RuntimeError("no free port range for Ray workers")


class RayCluster:
    """A Ray head started and stopped by this test (``ray start --head --block`` in its own session)."""

    def __init__(self, num_cpus: int = 8, num_gpus: int = 1) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="nemo-e2e-ray-", dir="/tmp")  # short: Ray's socket paths
        self.port, *fixed = free_ports(8)
        self.address = f"127.0.0.1:{self.port}"
        low = _free_range(avoid=(self.port, *fixed))
        names = ("--node-manager-port", "--object-manager-port", "--runtime-env-agent-port",
                 "--dashboard-agent-grpc-port", "--dashboard-agent-listen-port", "--metrics-export-port",
                 "--ray-client-server-port")
        ports = {**dict(zip(names, fixed)), "--min-worker-port": low, "--max-worker-port": low + 99}
        self.command = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.argv[0] = 'ray'; "
                        "main()", "start", "--head", "--block", f"--port={self.port}", "--node-ip-address=127.0.0.1",
                        f"--temp-dir={self.temp_dir}", f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}",
                        "--include-dashboard=false", "--disable-usage-stats", "--object-store-memory=200000000",
                        *(f"{k}={v}" for k, v in ports.items())]
        # token auth with this cluster's own token (not ~/.ray/auth_token, which other clusters share)
        self.env = {"RAY_ADDRESS": self.address, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex}
        self.process: subprocess.Popen | None = None
        self.log = Path(self.temp_dir) / "ray-start.log"

    def start(self, timeout: float = 120) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("GRPO_PATCHES", "RAY_"))}
        env.update({k: v for k, v in self.env.items() if k != "RAY_ADDRESS"})
        env["PYTHONPATH"] = ""  # the cluster's own processes need nothing of the run's path
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ray start exited {self.process.returncode}: {self.log.read_text()[-2000:]}")
            if "Ray runtime started" in self.log.read_text():
                return
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"ray start did not come up in {timeout} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        """SIGTERM to the head's process group (``--block`` then stops what it started), SIGKILL after
        30 s; then its temp dir goes (``GRPO_PATCHES_E2E_KEEP=1`` keeps it, with Ray's logs)."""
        self._stop()
        if not os.environ.get("GRPO_PATCHES_E2E_KEEP"):
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _stop(self) -> None:
        if self.process is None or self.process.poll() is not None and not _group_alive(self.process.pid):
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(self.process.pid):
                time.sleep(0.5)
            if not _group_alive(self.process.pid):
                break
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)

    def __enter__(self) -> "RayCluster":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie leader still counts: reap it
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pgid, os.WNOHANG)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _has_grpo_patches(site_dir: str) -> bool:
    return bool(glob.glob(os.path.join(site_dir, "grpo_patches*")) or glob.glob(os.path.join(site_dir, "__editable__*grpo_patches*")))


def worker_venv(root: Path) -> Path:
    """``root/<worker fqn>``: a venv of this interpreter that sees this environment's packages
    except grpo_patches (a site directory holding it is put on ``sys.path`` without running its
    ``.pth`` files, so its editable finder and start-up ``.pth`` stay inactive)."""
    venv = root / WORKER_FQN
    if not (venv / "bin" / "python").exists():
        subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(venv)],
                       check=True)
    site = next(venv.glob("lib/python3*/")) / "site-packages"
    lines = []
    for entry in sys.path:
        if not entry.endswith("site-packages") or not os.path.isdir(entry):
            continue
        lines.append(entry if _has_grpo_patches(entry) else f"import site; site.addsitedir({entry!r})")
    (site / "_e2e_driver_env.pth").write_text("\n".join(lines) + "\n")
    return venv


def assets(root: Path, shape: Shape = CELL) -> dict[str, Path]:
    """The tiny model and tokenizer directories and the data file (``input`` / ``output`` /
    ``pattern`` / ``filler`` per prompt, in the order the runs take them)."""
    from grpo_patches.demo import tiny_model

    model_dir, tokenizer_dir = root / f"tiny-qwen2-h{shape.hidden}-l{shape.layers}-s{shape.seed}", root / "tokenizer"
    if not (model_dir / "config.json").exists():
        tiny_model.build_model(seed=shape.seed, hidden_size=shape.hidden, num_layers=shape.layers).float() \
            .save_pretrained(model_dir)
    if not (tokenizer_dir / "tokenizer.json").exists():  # apart: next to a Qwen2 config, AutoTokenizer picks Qwen2's class
        tokenizer = tiny_model.build_tokenizer()
        tokenizer.chat_template = PASSTHROUGH_TEMPLATE  # the prompt is the question (the word vocabulary has no markup)
        tokenizer.save_pretrained(tokenizer_dir)
    words = [w for w in tiny_model.WORDS if not w.isdigit()]
    distinct = shape.distinct_prompts or shape.prompts_per_step * shape.steps
    rows = []
    for n in range(shape.prompts_per_step * shape.steps):
        i = n % distinct
        question = " ".join(words[(7 * i + j) % len(words)] for j in range(4 + i % 3))
        rows.append({"input": question, "output": str(i % 10), "pattern": shape.patterns[i % len(shape.patterns)],
                     "filler": shape.filler})
    data = root / f"math-{shape.prompts_per_step}x{shape.steps}-{distinct}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"model": model_dir, "tokenizer": tokenizer_dir, "data": data}


def overrides(files: dict[str, Path], log_dir: Path, train_batch: int, shape: Shape = CELL) -> list[str]:
    """``examples/configs/grpo_math_1B.yaml`` made tiny: fp32, SGD, KL 0, ``shape``'s steps, rollouts
    and micro-batches, ``train_batch`` rows per optimizer step, the stand-in generation's data,
    tensorboard logs, no checkpoints."""
    return [
        f"policy.model_name={files['model']}", f"policy.tokenizer.name={files['tokenizer']}",
        "policy.precision=float32", f"policy.train_global_batch_size={train_batch}",
        f"policy.train_micro_batch_size={shape.micro_batch}", f"policy.logprob_batch_size={shape.micro_batch}",
        f"policy.max_total_sequence_length={shape.max_length}",
        "policy.sequence_packing.enabled=false", "policy.dynamic_batching.enabled=false",
        "policy.optimizer.name=torch.optim.SGD", f"policy.optimizer.kwargs.lr={shape.lr}",
        "policy.optimizer.kwargs.weight_decay=0.0", "~policy.optimizer.kwargs.betas", "~policy.optimizer.kwargs.eps",
        "policy.max_grad_norm=1000.0", f"policy.generation.max_new_tokens={shape.max_length // 2}",
        f"grpo.num_prompts_per_step={shape.prompts_per_step}", f"grpo.num_generations_per_prompt={shape.samples}",
        f"grpo.max_num_steps={shape.steps}", "grpo.val_period=0", "grpo.val_at_start=false", "grpo.val_at_end=false",
        "loss_fn.reference_policy_kl_penalty=0.0",
        "data.shuffle=false", "data.num_workers=0", "data.train.dataset_name=ResponseDataset",
        f"++data.train.data_path={files['data']}", "data.train.split_validation_size=0", "data.default.prompt_file=null",
        "env.math.num_workers=1", "cluster.gpus_per_node=1", "cluster.num_nodes=1",
        f"logger.log_dir={log_dir}", "logger.tensorboard_enabled=true", "logger.monitor_gpus=false",
        "checkpointing.enabled=false",
    ]


@dataclass
class Run:
    """One run of ``examples/run_grpo.py`` and what it left."""

    returncode: int
    seconds: float
    output: str
    scalars: dict[str, dict[int, float]] = field(default_factory=dict)
    worker: list[dict[str, Any]] = field(default_factory=list)
    driver: list[dict[str, Any]] = field(default_factory=list)
    weights: Path | None = None

    def step_values(self, tag: str) -> list[float]:
        values = self.scalars.get(tag, {})
        return [values[s] for s in sorted(values)]


def read_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar NeMo-RL logged to tensorboard: ``{tag: {step: value}}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for events in sorted(log_dir.rglob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return out


def run_grpo(source: Path, work: Path, cluster: RayCluster, venvs: Path, files: dict[str, Path], train_batch: int,
             options: str | None, shape: Shape = CELL, timeout: float = 900, threads: int = 1,
             save_calls: tuple[int, ...] | None = None) -> Run:
    """``examples/run_grpo.py`` unpatched (``options is None``) or through ``grpo-patches run``.

    :param save_calls: the worker's train calls after which it saves its weights (0: before the
        first; ``None``: every one)."""
    work.mkdir(parents=True, exist_ok=True)
    log_dir = work / "logs"
    script = source / "examples" / "run_grpo.py"
    config = source / "examples" / "configs" / "grpo_math_1B.yaml"
    command = [sys.executable, str(script), "--config", str(config),
               *overrides(files, log_dir, train_batch, shape)]
    other_package: list[str] = []
    if options is not None:  # a copy of grpo_patches in GRPO_E2E_PYTHONPATH goes first (patched runs only)
        other_package = entry_points.other_package()
        command = entry_points.launched("nemo_rl", options, work.parent / "grpo-patches-startup", command)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GRPO_PATCHES", "RAY_"))}
    env.update({
        "PYTHONPATH": os.pathsep.join([*other_package, str(STARTUP),
                                       *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]),
        "GRPO_PATCHES_E2E_CPU": "1", "GRPO_PATCHES_E2E_DATA": str(files["data"]),
        "GRPO_PATCHES_E2E_TOKENIZER": str(files["tokenizer"]), "GRPO_PATCHES_E2E_DUMP": str(work),
        **cluster.env, "NEMO_RL_VENV_DIR": str(venvs), "NRL_FORCE_REBUILD_VENVS": "false",
        "NRL_DISABLE_NUMA_BINDING": "1", "NRL_SKIP_CONTAINER_FINGERPRINT_CHECK": "1", "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads),
        "PYTHONUNBUFFERED": "1",
    })
    if save_calls is not None:
        env["GRPO_PATCHES_E2E_SAVE_CALLS"] = ",".join(map(str, save_calls))
    start = time.perf_counter()
    returncode, output = entry_points.run_logged(command, work, env, timeout)

    def lines(name: str) -> list[dict[str, Any]]:
        path = work / name
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    worker = lines("worker.jsonl")
    saved = sorted(work.glob("weights-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    weights = saved[-1] if worker and saved else None
    return Run(returncode, time.perf_counter() - start, output, read_scalars(log_dir) if log_dir.exists() else {},
               worker, lines("driver.jsonl"), weights)


def source_root() -> Path:
    """The exported source the cell put on ``PYTHONPATH``: ``nemo_rl`` and ``examples`` side by side."""
    from grpo_patches.adapters.nemo_rl import PACKAGE
    from grpo_patches.adapters.nemo_rl.version import package_dir

    package = package_dir(PACKAGE)
    if package is None:
        raise RuntimeError("nemo_rl is not importable")
    return package.parent
