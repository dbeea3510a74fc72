"""``grpo-patches demo``: train the embedded tiny model with TRL twice, patches off and on.

Each run is a subprocess (a clean peak-memory reading and no shared state); both start
from the same saved model and seeds. Passes, rows and time are measured by an instrument
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


def _worker(patched: bool, steps: int, out: Path, progress: bool) -> None:
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
        def on_step_end(self, args, state, control, **kwargs):
            if bar is not None:
                bar.update(1)

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
    wall = time.perf_counter() - start
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
    from grpo_patches.demo.step_timer import TRAINER_SIDE

    def side(run: dict[str, Any], kind: str = "") -> float:
        return sum(run["time"][kind + name] for name in TRAINER_SIDE)

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
        ("wall time (s)", f"{off['wall_s']:.1f}", f"{on['wall_s']:.1f}"),
        ("peak memory (MB, process RSS)", f"{off['peak_rss_mb']:.0f}", f"{on['peak_rss_mb']:.0f}"),
        ("final reward", f"{off['final_reward']:.4f}", f"{on['final_reward']:.4f}"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':<{width}}  {'patches off':>14}  {'patches on':>14}", "-" * (width + 32)]
    lines += [f"{name:<{width}}  {a!s:>14}  {b!s:>14}" for name, a, b in rows]
    lines.append(f"{'max |weight difference|':<{width}}  {weight_diff:>30.3e}")
    return "\n".join(lines)


def run_demo(steps: int | None = None, progress: bool = True) -> int:
    """Run both trainings and print the comparison table. Returns a process exit code."""
    steps = steps or DEFAULT_STEPS
    print(f"Training the embedded tiny Qwen2 model with TRL GRPOTrainer for {steps} optimizer steps, twice "
          f"(GA=3, steps_per_generation=2, identical rewards for half the prompts).", flush=True)
    with tempfile.TemporaryDirectory(prefix="grpo_patches_demo_") as tmp:
        work = Path(tmp)
        results = {}
        for name in ("off", "on"):
            cmd = [sys.executable, "-m", "grpo_patches.demo", "--worker", name, "--steps", str(steps), "--out",
                   str(work / name)] + ([] if progress else ["--no-progress"])
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
            env.pop("GRPO_PATCHES", None)  # the demo controls patching itself
            if subprocess.run(cmd, env=env).returncode != 0:
                print(f"demo: the patches-{name} run failed", file=sys.stderr)
                return 1
            results[name] = json.loads((work / f"{name}.json").read_text())
        diff = _max_weight_difference(work / "off.pt", work / "on.pt")
    print()
    print(format_table(results["off"], results["on"], diff))
    return 0


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
    args = parser.parse_args(argv)
    _worker(args.worker == "on", args.steps, args.out, not args.no_progress)
    return 0
