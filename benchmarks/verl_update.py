"""verl's actor update, patched (zero-advantage filter) vs unpatched, at 0 / 50 / 75 % zero-advantage rows.

Runs verl's own ``DataParallelPPOActor.update_policy`` (the legacy line, the default worker of
verl 0.6-0.7) on CPU in fp32: a Qwen2-style model built from a config (no download), one
batch of ``--rows`` rollouts (prompt + response tokens), static micro-batches. Every
measurement is its own process (``--worker``), configurations run round-robin, each process
times one update after a small warm-up update. Reported: the median per configuration and the
ratio patched / unpatched from the same run, as a table, JSON and a PNG chart.

    compat/.nox/cpu-verl-0-7-1/bin/python benchmarks/verl_update.py --hidden 256 --layers 2 --vocab 8192   # the run in benchmarks/RESULTS.md
    compat/.nox/cpu-verl-0-7-1/bin/python benchmarks/verl_update.py --quick   # a smoke run

(that interpreter: verl 0.7.1's compat venv, made by ``bash scripts/run compat``; any venv with
verl 0.6-0.7 and grpo_patches will do.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET_AT_75 = 0.4  # patched update time <= 0.4 x unpatched at 75 % zero-advantage rows


def build(spec: dict):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=2 * spec["hidden"],
                         num_hidden_layers=spec["layers"], num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=1024, tie_word_embeddings=True, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).float()


def batch(spec: dict, zero_fraction: float, seed: int = 3) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    rows, p, r = spec["rows"], spec["prompt"], spec["response"]
    ids = torch.randint(3, spec["vocab"], (rows, p + r), generator=g)
    attn = torch.ones(rows, p + r, dtype=torch.long)
    for i in range(rows):
        attn[i, p + int(torch.randint(r // 2, r + 1, (1,), generator=g)) :] = 0
    adv = torch.randn(rows, generator=g)
    adv[torch.randperm(rows, generator=g)[: int(round(zero_fraction * rows))]] = 0.0  # spread over micro-batches
    mask = attn[:, p:]
    return {"input_ids": ids, "attention_mask": attn, "position_ids": torch.clamp(attn.cumsum(1) - 1, min=0),
            "responses": ids[:, p:].clone(), "response_mask": mask, "advantages": adv[:, None] * mask,
            "old_log_probs": torch.zeros(rows, r)}


def worker(spec: dict, patched: bool, zero_fraction: float) -> dict:
    """One process: a warm-up update on a few rows, then the timed update of the whole batch."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    import grpo_patches
    from verl import DataProto
    from verl.workers.actor.dp_actor import DataParallelPPOActor
    from verl.workers.config import FSDPActorConfig, FSDPEngineConfig

    if patched:
        grpo_patches.enable("verl", zero_advantage_filter=True)
    model = build(spec)
    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=spec["rows"] // spec["mini_batches"],
                             ppo_micro_batch_size_per_gpu=spec["micro"], use_torch_compile=False,
                             fsdp_config=FSDPEngineConfig(dtype="float32"), loss_agg_mode="token-mean")
    actor = DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=1e-4))
    warm = {k: v[: spec["micro"] * spec["mini_batches"]] for k, v in batch(spec, zero_fraction).items()}
    start = time.perf_counter()
    actor.update_policy(DataProto.from_dict(tensors=warm, meta_info={"temperature": 1.0}))  # first-call costs
    warmup = time.perf_counter() - start
    data = DataProto.from_dict(tensors=batch(spec, zero_fraction), meta_info={"temperature": 1.0})
    start = time.perf_counter()
    metrics = actor.update_policy(data)
    elapsed = time.perf_counter() - start
    return {"time_s": elapsed, "warmup_s": warmup, "rows_dropped": metrics.get("grpo_patches/rows_dropped", 0.0)}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_one(spec: dict, patched: bool, zero_fraction: float) -> dict:
    args = [sys.executable, __file__, "--worker", json.dumps({**spec, "port": _free_port()}), str(int(patched)),
            str(zero_fraction)]
    proc = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "GRPO_PATCHES": ""})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker failed: {proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def summarise(spec: dict, samples: dict) -> list[dict]:
    rows = []
    for fraction in spec["fractions"]:
        off = statistics.median(s["time_s"] for s in samples[(fraction, False)])
        on = statistics.median(s["time_s"] for s in samples[(fraction, True)])
        rows.append({"zero_fraction": fraction, "unpatched_s": off, "patched_s": on, "ratio": on / off,
                     "rows_dropped": samples[(fraction, True)][0]["rows_dropped"],
                     "unpatched_all_s": [s["time_s"] for s in samples[(fraction, False)]],
                     "patched_all_s": [s["time_s"] for s in samples[(fraction, True)]]})
    return rows


def table(rows: list[dict]) -> str:
    head = f"{'zero-adv rows':>13} {'unpatched s':>12} {'patched s':>10} {'ratio':>7} {'rows dropped':>13}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['zero_fraction']:>12.0%} {r['unpatched_s']:>12.2f} {r['patched_s']:>10.2f} "
                     f"{r['ratio']:>6.2f}x {r['rows_dropped']:>13.0f}")
    return "\n".join(lines)


def chart(path: Path, rows: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['zero_fraction']:.0%}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.bar([i - 0.2 for i in x], [r["unpatched_s"] for r in rows], 0.4, label="verl (unpatched)")
    ax.bar([i + 0.2 for i in x], [r["patched_s"] for r in rows], 0.4, label="grpo_patches filter")
    for i, r in enumerate(rows):
        ax.text(i + 0.2, r["patched_s"], f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("rows with advantage exactly 0")
    ax.set_ylabel("update_policy time (s, median)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a small model, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    if args.worker:
        spec, patched, fraction = json.loads(args.worker[0]), bool(int(args.worker[1])), float(args.worker[2])
        print("RESULT " + json.dumps(worker(spec, patched, fraction)), flush=True)
        return
    spec = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "rows": args.rows, "prompt": 32,
            "response": 96, "micro": 4, "mini_batches": 2, "threads": 2, "fractions": [0.0, 0.5, 0.75]}
    if args.quick:
        spec.update(hidden=128, layers=2, vocab=4096, response=32)
        args.repeats = 1
    from importlib import metadata

    samples: dict = {(f, p): [] for f in spec["fractions"] for p in (False, True)}
    for repeat in range(args.repeats):  # round-robin: every configuration once per repeat
        for fraction in spec["fractions"]:
            for patched in (False, True):
                result = run_one(spec, patched, fraction)
                samples[(fraction, patched)].append(result)
                print(f"repeat {repeat} zero={fraction:.0%} {'patched' if patched else 'unpatched'}: "
                      f"{result['time_s']:.2f} s", flush=True)
    rows = summarise(spec, samples)
    print(table(rows))
    at75 = next((r for r in rows if r["zero_fraction"] == 0.75), None)
    verdict = None if at75 is None else at75["ratio"] <= TARGET_AT_75
    print(f"target at 75 %: patched <= {TARGET_AT_75}x unpatched: {'met' if verdict else 'NOT met'}")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.date.today().isoformat(), "verl": metadata.version("verl"),
            "torch": metadata.version("torch"), "spec": spec, "repeats": args.repeats, "cpu_count": os.cpu_count(),
            "target_at_75": TARGET_AT_75, "target_met": verdict}
    (args.out / "verl_update.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    title = (f"verl {meta['verl']} update_policy, Qwen2 h{spec['hidden']} x{spec['layers']} V{spec['vocab']}, "
             f"{spec['rows']} rows x {spec['prompt'] + spec['response']} tokens, CPU fp32")
    chart(args.out / "verl_update.png", rows, title)
    print(f"wrote {args.out / 'verl_update.json'} and {args.out / 'verl_update.png'}")


if __name__ == "__main__":
    main()
