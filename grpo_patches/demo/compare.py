"""``grpo-patches demo``: train the embedded tiny model with TRL twice, patches off and on.

Each run is a subprocess (a clean peak-memory reading and no shared state); both start
from the same saved model and seeds. The two run in lockstep, one optimizer step each in turn
(:class:`Lockstep`): only one trains at any moment and both see the same load from the rest
of the machine, so a busy machine cannot make the time ratio read as a slowdown. Passes, rows and time are measured by an instrument
independent of the patches (:mod:`grpo_patches.demo.step_timer`: TRL's log-prob method wrapped
beneath them, the loss, backward and optimizer around them), so the table does not rely on
the adapter's own bookkeeping. Generation (sampling, rewards) is timed apart: on a tiny model
it dominates the wall time and the patches do not touch it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from grpo_patches.demo import DEFAULT_STEPS, trl_config

#: The demo's training setup: GA=3 with steps_per_generation=2 is misaligned, so upstream
#: TRL recomputes old log-probs for every rollout; half the prompts get identical rewards
#: for all their completions, so their advantages are exactly zero.
DEMO_CONFIG: dict[str, Any] = {
    **trl_config.BASE_CONFIG,
    "max_completion_length": 12,
    "learning_rate": 2e-2,
    "bf16": False,  # GRPOConfig turns on bf16 autocast by default, even on CPU: keep the demo in fp32
}
#: Wider than the tests' model, with a realistic lm-head share (vocab 8192), so that the work
#: saved shows in the trainer-side time next to per-call overhead.
MODEL_HIDDEN, MODEL_LAYERS, MODEL_VOCAB = 256, 4, 8192


def _quiet_libraries() -> None:
    """No progress bars of transformers (weight loading) or datasets: the demo's own step bar
    (or, with ``--no-progress``, nothing) is the progress shown."""
    import datasets
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    datasets.disable_progress_bars()


class Lockstep:
    """The worker's side of the turn-taking: before each optimizer step it waits for its turn (one
    byte on ``go``), after it it says so (one byte on ``done``). File descriptors from the parent."""

    def __init__(self, go: int, done: int) -> None:
        self.go, self.done = go, done
        self.waited = 0.0  # seconds spent waiting for a turn: not this run's time

    def wait_turn(self) -> None:
        start = time.perf_counter()
        if not os.read(self.go, 1):
            raise SystemExit("demo: the parent process went away")
        self.waited += time.perf_counter() - start

    def step_done(self) -> None:
        os.write(self.done, b".")


def _worker(patched: bool, steps: int, out: Path, progress: bool, lockstep: Lockstep | None = None) -> None:
    """One training run; writes its numbers to ``out``.json and weights to ``out``.pt."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    import grpo_patches
    from grpo_patches import savings
    from grpo_patches.demo import tiny_model
    from grpo_patches.demo.step_timer import StepTimer

    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notes via TRL
    _quiet_libraries()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    timer = StepTimer()
    timer.install(GRPOTrainer)  # beneath the patches: passes and rows that really run
    if patched:
        grpo_patches.enable("trl")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, desc=f"patches {'on ' if patched else 'off'}", unit="step", file=sys.stderr)

    class Progress(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if lockstep is not None:
                lockstep.wait_turn()

        def on_step_end(self, args, state, control, **kwargs):
            if bar is not None:
                bar.update(1)
            if lockstep is not None:
                lockstep.step_done()

    path = tiny_model.tiny_model_path(out.parent / "model", hidden_size=MODEL_HIDDEN, num_layers=MODEL_LAYERS,
                                      vocab_size=MODEL_VOCAB)
    trainer = GRPOTrainer(
        model=path,
        reward_funcs=tiny_model.reward_constant_per_prompt,
        args=GRPOConfig(output_dir=str(out.parent / "trainer"), max_steps=steps, **DEMO_CONFIG),
        train_dataset=tiny_model.prompt_dataset(16),
        processing_class=tiny_model.load_tokenizer(path),
        callbacks=[Progress()],
    )
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # the table below is the output, not per-step log dicts
    timer.attach(trainer)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start - (lockstep.waited if lockstep is not None else 0.0)
    if bar is not None:
        bar.close()
    rewards = [row["reward"] for row in trainer.state.log_history if "reward" in row]
    saved = savings.totals("trl")
    torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, out.with_suffix(".pt"))
    result = {
        **timer.passes,
        "rows": timer.rows,
        "time": timer.totals,
        "rows_dropped": saved.get("rows_dropped", 0),
        "wall_s": wall,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "final_reward": rewards[-1] if rewards else float("nan"),
        "savings": saved,
    }
    out.with_suffix(".json").write_text(json.dumps(result))


def format_table(off: dict[str, Any], on: dict[str, Any], weight_diff: float) -> str:
    side = _trainer_side
    ratio = side(on) / side(off) if side(off) else float("nan")
    cpu_ratio = side(on, "cpu_") / side(off, "cpu_") if side(off, "cpu_") else float("nan")
    rows = [
        ("old-logprob passes (rows)", f"{off['old_logprob_passes']} ({off['rows']['old_logprobs']})",
         f"{on['old_logprob_passes']} ({on['rows']['old_logprobs']})"),
        ("reference passes", off["reference_passes"], on["reference_passes"]),
        ("policy-forward rows, with autograd", off["rows"]["policy_with_grad"], on["rows"]["policy_with_grad"]),
        ("rows dropped from the update", off["rows_dropped"], on["rows_dropped"]),
        ("trainer-side time (s)", f"{side(off):.1f}", f"{side(on):.1f} ({ratio:.2f}x)"),
        # CPU seconds (all threads) vary less with other processes' load than wall seconds
        ("trainer-side CPU time (s)", f"{side(off, 'cpu_'):.1f}", f"{side(on, 'cpu_'):.1f} ({cpu_ratio:.2f}x)"),
        *((f"  {label}", f"{off['time'][name]:.1f}", f"{on['time'][name]:.1f}")
          for name, label in (("old_logprobs", "old-logprob passes"), ("policy_forward", "policy forward + loss"),
                              ("backward", "backward"), ("optimizer", "optimizer"))),
        ("generation + rewards (s, apart)", f"{off['time']['generation']:.1f}", f"{on['time']['generation']:.1f}"),
        ("wall time of training (s)", f"{off['wall_s']:.1f}", f"{on['wall_s']:.1f}"),
        ("peak memory (MB, process RSS)", f"{off['peak_rss_mb']:.0f}", f"{on['peak_rss_mb']:.0f}"),
        ("final reward", f"{off['final_reward']:.4f}", f"{on['final_reward']:.4f}"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':<{width}}  {'patches off':>14}  {'patches on':>14}", "-" * (width + 32)]
    lines += [f"{name:<{width}}  {a!s:>14}  {b!s:>14}" for name, a, b in rows]
    lines.append(f"{'max |weight difference|':<{width}}  {weight_diff:>30.3e}")
    return "\n".join(lines)


def run_demo(steps: int | None = None, progress: bool = True) -> int:
    """Run both trainings in lockstep and print what they show, then the comparison table.
    Returns a process exit code."""
    steps = steps or DEFAULT_STEPS
    print(f"Training the embedded tiny Qwen2 model with TRL GRPOTrainer for {steps} optimizer steps, twice "
          f"(GA=3, steps_per_generation=2, identical rewards for half the prompts), patches off and on, "
          f"one optimizer step each in turn.", flush=True)
    with tempfile.TemporaryDirectory(prefix="grpo_patches_demo_") as tmp:
        work = Path(tmp)
        runs = {name: _start(name, steps, work) for name in ("off", "on")}
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=steps, desc="steps (off, then on)", unit="step", file=sys.stderr)
        finished = _take_turns(runs, steps, bar)
        if bar is not None:
            bar.close()
        codes = {name: run.wait() for name, run in runs.items()}  # closing the pipes ends a run left waiting
        failed = [name for name, code in codes.items() if code != 0]
        if failed or not finished:
            print(f"demo: the patches-{' and '.join(failed) or 'off / on'} run failed", file=sys.stderr)
            return 1
        results = {name: json.loads((work / f"{name}.json").read_text()) for name in runs}
        diff = _max_weight_difference(work / "off.pt", work / "on.pt")
    print()
    print(format_summary(results["off"], results["on"], diff, steps))
    print()
    print(format_table(results["off"], results["on"], diff))
    return 0


class _Run:
    """One worker process and the two pipes of its turn-taking."""

    def __init__(self, process: subprocess.Popen, go: int, done: int) -> None:
        self.process, self.go, self.done = process, go, done

    def step(self) -> bool:
        """Let it take one optimizer step; ``False`` if it ended instead."""
        try:
            os.write(self.go, b".")
        except BrokenPipeError:
            return False
        return bool(os.read(self.done, 1))

    def wait(self) -> int:
        os.close(self.go)
        os.close(self.done)
        return self.process.wait()


def _start(name: str, steps: int, work: Path) -> _Run:
    go_read, go_write = os.pipe()
    done_read, done_write = os.pipe()
    cmd = [sys.executable, "-m", "grpo_patches.demo", "--worker", name, "--steps", str(steps), "--out",
           str(work / name), "--no-progress", "--lockstep", f"{go_read},{done_write}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("GRPO_PATCHES", None)  # the demo controls patching itself
    process = subprocess.Popen(cmd, env=env, pass_fds=(go_read, done_write))
    os.close(go_read)
    os.close(done_write)
    return _Run(process, go_write, done_read)


def _take_turns(runs: dict[str, _Run], steps: int, bar: Any) -> bool:
    """Round-robin: each run one optimizer step in turn; ``False`` when one stopped early."""
    for _ in range(steps):
        for run in runs.values():
            if not run.step():
                return False
        if bar is not None:
            bar.update(1)
    return True


def _trainer_side(run: dict[str, Any], kind: str = "") -> float:
    from grpo_patches.demo.step_timer import TRAINER_SIDE

    return sum(run["time"][kind + name] for name in TRAINER_SIDE)


def format_summary(off: dict[str, Any], on: dict[str, Any], weight_diff: float, steps: int) -> str:
    """What the demo shows, in three lines: the same result, less work, the time it saved."""
    same = "bitwise identical" if weight_diff == 0.0 else f"equal to {weight_diff:.1e} (max |difference|)"
    wall = _trainer_side(on) / _trainer_side(off) if _trainer_side(off) else float("nan")
    cpu = _trainer_side(on, "cpu_") / _trainer_side(off, "cpu_") if _trainer_side(off, "cpu_") else float("nan")
    return "\n".join([
        f"Same result:  the final weights after {steps} optimizer steps are {same}.",
        f"Less work:    old-logprob passes {off['old_logprob_passes']} -> {on['old_logprob_passes']}, "
        f"policy-forward rows with autograd {off['rows']['policy_with_grad']} -> {on['rows']['policy_with_grad']}, "
        f"{on['rows_dropped']} zero-advantage rows left out of the update.",
        f"Less time:    trainer side {wall:.2f}x the unpatched time ({cpu:.2f}x in CPU seconds); the two runs took "
        f"turns step by step, so both saw the same load (generation apart: the patches do not touch it).",
    ])


def _max_weight_difference(a: Path, b: Path) -> float:
    import torch

    w_a, w_b = torch.load(a), torch.load(b)
    return max(float((w_a[k] - w_b[k]).abs().max()) for k in w_a)


def main(argv: list[str] | None = None) -> int:
    """One training run (``python -m grpo_patches.demo --worker on|off``), started by :func:`run_demo`."""
    parser = argparse.ArgumentParser(prog="python -m grpo_patches.demo", description="internal: one demo training run")
    parser.add_argument("--worker", choices=["off", "on"], required=True)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--lockstep", default=None, help="GO_FD,DONE_FD: take turns with another run (run_demo)")
    args = parser.parse_args(argv)
    lockstep = Lockstep(*map(int, args.lockstep.split(","))) if args.lockstep else None
    _worker(args.worker == "on", args.steps, args.out, not args.no_progress, lockstep)
    return 0
