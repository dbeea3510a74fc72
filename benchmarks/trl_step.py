"""Benchmark: the training side of a TRL GRPOTrainer optimizer step, unpatched vs grpo_patches.

Per component (old-logprob passes, policy forward, backward, optimizer; generation reported
apart) and per share of zero-advantage rows, for: TRL unpatched, grpo_patches with its
defaults (``dropped_rows_metrics=False``), and with ``dropped_rows_metrics=True``. Every run
is its own process (``_trl_step_worker.py``); runs go round-robin (round 1: every fraction x
variant, then round 2, ...), so slow phases of a shared machine hit every variant alike. Per
run: the mean per optimizer step over the steps after the warm-up (an even number: GA=3 with
steps_per_generation=2 repeats every 2 optimizer steps); reported: the median over rounds, and
the ratio to the unpatched run of the same round (median over rounds).

``--verify`` adds grpo_patches with ``verify_every=1`` (every optimizer step is a verify step)
and reports the cost of a verify step against a normal one: its training side over the
patched run's of the same round (median over rounds), with the largest verify figures logged.

    python benchmarks/trl_step.py --quick           # smoke test: small model, 1 round (~3 min)
    python benchmarks/trl_step.py                   # the issue's setup, 3 rounds (~30-40 min on 2 cores)
    python benchmarks/trl_step.py --quick --verify --fractions 0.5 --variants patched --rounds 3

Writes a table (stdout and ``trl_step.md``), ``trl_step.json`` and ``trl_step.png`` to --out-dir.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMPONENTS = ("old_logprobs", "policy_forward", "backward", "optimizer")
LABELS = {"old_logprobs": "old-logprob passes", "policy_forward": "policy forward", "backward": "backward",
          "optimizer": "optimizer"}
VARIANTS = {  # name -> grpo_patches.enable options (None: unpatched)
    "unpatched": None,
    "patched": {},
    "patched_metrics": {"dropped_rows_metrics": True},
    "patched_verify": {"verify_every": 1},  # --verify: every step a verify step
    "patched_tiled": {"tiled_loss": True},  # the tiled lm-head loss too (the fused Triton fold on CUDA)
    "patched_packed": {"pack_kept_rows": True},  # the kept rows of a window dealt into full micro-batches
}
VARIANT_LABELS = {"unpatched": "unpatched", "patched": "patched (defaults)",
                  "patched_metrics": "patched, dropped_rows_metrics=True",
                  "patched_verify": "patched, verify_every=1", "patched_tiled": "patched, tiled_loss=True",
                  "patched_packed": "patched, pack_kept_rows=True"}
TARGET = 0.30  # training side at 75 % zero-advantage rows <= 0.30 x unpatched
QUICK = {"hidden": 64, "layers": 2, "vocab": 1024, "completion_tokens": 16, "steps": 4, "warmup": 2, "rounds": 1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.5, 0.75], help="zero-advantage row shares")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS),
                   default=[v for v in VARIANTS if v not in ("patched_verify", "patched_tiled", "patched_packed")])
    p.add_argument("--verify", action="store_true",
                   help="add patched with verify_every=1 (and patched): the cost of a verify step vs a normal one")
    p.add_argument("--rounds", type=int, default=3, help="round-robin repetitions (median)")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the mean")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--completion-tokens", type=int, default=64)
    p.add_argument("--rows", type=int, default=16, help="rows per micro-batch (per_device_train_batch_size)")
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--ga", type=int, default=3, help="gradient_accumulation_steps")
    p.add_argument("--spg", type=int, default=2, help="steps_per_generation")
    p.add_argument("--prompt-words", type=int, default=16)
    p.add_argument("--threads", type=int, default=2, help="torch threads per run")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where TRL trains (fp32 either way; the timer waits for CUDA's queue per component)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--out-dir", type=Path, default=HERE / "results")
    p.add_argument("--quick", action="store_true", help=f"smoke test: {QUICK}")
    if p.parse_known_args(argv)[0].quick:
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    if (args.steps - args.warmup) <= 0:
        p.error("--steps must exceed --warmup")
    if args.verify:
        args.variants = list(dict.fromkeys([*args.variants, "patched", "patched_verify"]))
    return args


def run_one(args: argparse.Namespace, variant: str, fraction: float, tmp: Path) -> dict:
    prompts_per_rollout = args.rows * args.spg // args.generations
    spec = {
        "options": VARIANTS[variant], "zero_fraction": fraction, "hidden": args.hidden, "layers": args.layers,
        "vocab": args.vocab, "completion_tokens": args.completion_tokens, "rows": args.rows,
        "generations": args.generations, "ga": args.ga, "spg": args.spg, "steps": args.steps,
        "warmup": args.warmup, "threads": args.threads, "device": args.device, "prompt_words": args.prompt_words,
        "prompts": max(64, 4 * args.steps * args.ga * prompts_per_rollout),
        "model_dir": str(tmp / "model"), "output_dir": str(tmp / f"out_{variant}_{fraction}"),
        "result_path": str(tmp / f"result_{variant}_{fraction}.json"),
    }
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore")
    env.pop("GRPO_PATCHES", None)
    Path(spec["result_path"]).unlink(missing_ok=True)
    try:
        proc = subprocess.run([sys.executable, str(HERE / "_trl_step_worker.py"), json.dumps(spec)], env=env,
                              capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"error: timed out after {args.timeout}s"}
    path = Path(spec["result_path"])
    if not path.exists():
        return {"status": f"error: exit {proc.returncode}: {(proc.stderr or '')[-500:]}"}
    return json.loads(path.read_text())


def summarize(runs: list[dict], variants: list[str], fractions: list[float]) -> list[dict]:
    """One row per (fraction, variant): median seconds per component, ratio to unpatched."""
    rows = []
    for fraction in fractions:
        base = {r["round"]: r for r in runs if r["variant"] == "unpatched" and r["fraction"] == fraction
                and r["status"] == "ok"}
        for variant in variants:
            mine = [r for r in runs if r["variant"] == variant and r["fraction"] == fraction and r["status"] == "ok"]
            if not mine:
                rows.append({"fraction": fraction, "variant": variant, "status": "failed"})
                continue
            row = {"fraction": fraction, "variant": variant, "status": "ok", "runs": len(mine)}
            for name in mine[0]["per_step"]:
                row[name] = statistics.median(r["per_step"][name] for r in mine)
            for key, name in (("vs_unpatched", "trainer_side"), ("cpu_vs_unpatched", "cpu_trainer_side")):
                ratios = [r["per_step"][name] / base[r["round"]]["per_step"][name] for r in mine if r["round"] in base]
                row[key] = statistics.median(ratios) if ratios else None
            if variant == "patched_verify":  # a verify step against a normal patched one, same round
                normal = {r["round"]: r for r in runs if r["variant"] == "patched" and r["fraction"] == fraction
                          and r["status"] == "ok"}
                for key, name in (("vs_patched", "trainer_side"), ("cpu_vs_patched", "cpu_trainer_side")):
                    ratios = [r["per_step"][name] / normal[r["round"]]["per_step"][name] for r in mine
                              if r["round"] in normal]
                    row[key] = statistics.median(ratios) if ratios else None
                row["verify_figures"] = {name: max(r["verify_figures"].get(name, 0.0) for r in mine)
                                         for name in sorted({n for r in mine for n in r.get("verify_figures", {})})}
            first = [abs(r["grad_norm"][0] / base[r["round"]]["grad_norm"][0] - 1)
                     for r in mine if r["round"] in base and r["grad_norm"] and base[r["round"]]["grad_norm"]]
            row["grad_norm_step1_rel_diff"] = max(first) if first else None
            row["rows"] = mine[0]["rows"]
            row["calls"] = mine[0].get("policy_calls_per_step")
            row["savings"] = mine[0]["savings"]
            rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    head = ("| zero rows | variant | " + " | ".join(LABELS[c] for c in COMPONENTS)
            + " | training side | × unpatched | CPU s, training side | × unpatched (CPU) | generation (apart) "
              "| step-1 grad-norm rel. diff | forward/backward calls per step |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['fraction']:.0%} | {VARIANT_LABELS[r['variant']]} | failed |")
            continue
        comps = " | ".join(f"{r[c]:.2f}" for c in COMPONENTS)
        ratio = "-" if r["vs_unpatched"] is None else f"{r['vs_unpatched']:.2f}"
        cpu_ratio = "-" if r["cpu_vs_unpatched"] is None else f"{r['cpu_vs_unpatched']:.2f}"
        diff = "-" if r["grad_norm_step1_rel_diff"] is None or r["variant"] == "unpatched" else \
            f"{r['grad_norm_step1_rel_diff']:.1e}"
        calls = "-" if r.get("calls") is None else f"{r['calls']:.2f}"
        lines.append(f"| {r['fraction']:.0%} | {VARIANT_LABELS[r['variant']]} | {comps} | {r['trainer_side']:.2f} | "
                     f"{ratio} | {r['cpu_trainer_side']:.2f} | {cpu_ratio} | {r['generation']:.2f} | {diff} | {calls} |")
    return "\n".join(lines)


def write_chart(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no chart", file=sys.stderr)
        return
    ok = [r for r in rows if r["status"] == "ok"]
    labels = [f"{r['fraction']:.0%}\n{r['variant'].replace('patched_metrics', 'metrics=True')}" for r in ok]
    fig, ax = plt.subplots(figsize=(max(6, len(ok) * 1.1), 4.5))
    bottom = [0.0] * len(ok)
    for component in COMPONENTS:
        values = [r[component] for r in ok]
        ax.bar(range(len(ok)), values, bottom=bottom, label=LABELS[component])
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, r in enumerate(ok):
        if r["vs_unpatched"] is not None and r["variant"] != "unpatched":
            ax.text(i, bottom[i], f"{r['vs_unpatched']:.2f}×", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(ok)), labels, fontsize=7)
    ax.set_ylabel("seconds per optimizer step")
    ax.set_title("TRL GRPOTrainer, training side of an optimizer step (median)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    variants = ["unpatched", *[v for v in args.variants if v != "unpatched"]]
    runs: list[dict] = []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="trl_step_bench_") as tmp_name:
        tmp = Path(tmp_name)
        for round_ in range(args.rounds):
            for fraction in args.fractions:
                for variant in variants:
                    print(f"[round {round_ + 1}/{args.rounds}] zero rows {fraction:.0%}, {variant} ...", end=" ",
                          flush=True)
                    result = run_one(args, variant, fraction, tmp)
                    result.update(round=round_, fraction=fraction, variant=variant)
                    runs.append(result)
                    print(f"{result['per_step']['trainer_side']:.2f} s/step" if result["status"] == "ok"
                          else result["status"][:300], flush=True)
    rows = summarize(runs, variants, args.fractions)
    table = format_table(rows)
    setup = (f"Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; completions "
             f"{args.completion_tokens} tokens; {args.rows} rows per micro-batch, {args.generations} generations, "
             f"GA={args.ga}, steps_per_generation={args.spg}; fixed completions; {args.threads} torch threads; "
             f"{args.steps} steps per run, first {args.warmup} left out; median of {args.rounds} round(s)")
    date = datetime.date.today().isoformat()
    print(f"\nSeconds per optimizer step ({setup}; {date}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, {time.time() - started:.0f} s in all):\n")
    print(table)
    for r in rows:
        if r["status"] == "ok" and r["variant"] == "patched_verify" and r.get("vs_patched") is not None:
            figures = ", ".join(f"{name.rsplit('/', 1)[-1]} <= {value:.1e}" for name, value in r["verify_figures"].items())
            print(f"\nVerify step cost at {r['fraction']:.0%} zero rows: {r['vs_patched']:.2f}x a normal patched step "
                  f"(training side, wall; {r['cpu_vs_patched']:.2f}x CPU; median over {r['runs']} round(s)); "
                  f"figures: {figures or 'none'}")
    at75 = [r for r in rows if r["status"] == "ok" and r["fraction"] == 0.75 and r["variant"] == "patched"]
    if at75 and at75[0]["vs_unpatched"] is not None:
        wall, cpu = at75[0]["vs_unpatched"], at75[0]["cpu_vs_unpatched"]
        verdict = "met" if wall <= TARGET else "NOT met"
        print(f"\nTarget: training side at 75 % zero rows <= {TARGET:.2f}x unpatched: {wall:.2f}x wall "
              f"({verdict}), {cpu:.2f}x CPU")
    stem = "trl_step_quick" if args.quick else "trl_step"
    (args.out_dir / f"{stem}.md").write_text(f"{setup}; {date}\n\n{table}\n")
    (args.out_dir / f"{stem}.json").write_text(json.dumps({"setup": vars(args) | {"out_dir": str(args.out_dir)},
                                                           "date": date, "rows": rows, "runs": runs}, indent=1))
    write_chart(rows, args.out_dir / f"{stem}.png")
    print(f"\nwrote {args.out_dir / stem}.{{md,json,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
