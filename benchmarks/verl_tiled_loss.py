"""verl's actor update with the tiled lm-head loss vs verl's own fused kernels vs the dense path.

Runs verl's own ``DataParallelPPOActor.update_policy`` (legacy line, verl 0.6-0.7) on CPU in
fp32 on a Qwen2-style model whose lm head dominates (large vocabulary), no zero-advantage rows:

* ``dense``: verl unpatched, HF logits ``[tokens, vocab]``;
* ``fused``: verl unpatched with ``use_fused_kernels=True`` (its chunked ``FusedLinearForPPO``,
  torch backend, which recomputes the logits in the backward);
* ``tiled``: the same fused forward answered by grpo_patches' tiled loss (``tiled_loss=True``).

Every measurement is its own process; configurations run round-robin; each process does a
warm-up update on a few rows, then times one update of the whole batch and the peak resident
memory it added (VmHWM reset through ``/proc/self/clear_refs`` just before). Reported: medians
and the ratios to ``fused`` and ``dense`` from the same run, as a table and JSON.

    compat/.nox/cpu-verl-0-7-1/bin/python benchmarks/verl_tiled_loss.py   # the run in benchmarks/RESULTS.md
    compat/.nox/cpu-verl-0-7-1/bin/python benchmarks/verl_tiled_loss.py --quick   # a smoke run

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
sys.path.insert(0, str(HERE))
from verl_update import _free_port, batch, build  # noqa: E402

CONFIGS = ("dense", "fused", "tiled")


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def worker(spec: dict, config: str) -> dict:
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

    if config == "tiled":
        grpo_patches.enable("verl", tiled_loss=True, zero_advantage_filter=False, logprob_skip=False)
    model = build(spec)
    if config != "dense":
        from verl.models.transformers.monkey_patch import patch_forward_with_backends

        patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
    actor_config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=spec["rows"],
                                   ppo_micro_batch_size_per_gpu=spec["micro"], use_torch_compile=False,
                                   use_fused_kernels=config != "dense", fsdp_config=FSDPEngineConfig(dtype="float32"),
                                   loss_agg_mode="token-mean")
    actor = DataParallelPPOActor(actor_config, model, torch.optim.SGD(model.parameters(), lr=1e-4))
    from verl.utils.experimental.torch_functional import FusedLinearForPPOFunction

    fused_calls, apply = [], FusedLinearForPPOFunction.apply
    FusedLinearForPPOFunction.apply = lambda *a, **k: (fused_calls.append(1), apply(*a, **k))[1]  # proves the path
    full = batch(spec, 0.0)
    full["old_log_probs"] = torch.randn(full["old_log_probs"].shape, generator=torch.Generator().manual_seed(5)) * 0.1 - 9
    warm = {k: v[:2] for k, v in full.items()}
    actor.update_policy(DataProto.from_dict(tensors=warm, meta_info={"temperature": 1.0}))  # first-call costs
    data = DataProto.from_dict(tensors=full, meta_info={"temperature": 1.0})
    rss_before = _status_kb("VmRSS")
    peak_ok = _reset_peak()
    start = time.perf_counter()
    metrics = actor.update_policy(data)
    elapsed = time.perf_counter() - start
    peak_mb = (_status_kb("VmHWM") - rss_before) / 1024 if peak_ok else float("nan")
    return {"time_s": elapsed, "peak_added_mb": peak_mb, "pg_loss": float(metrics["actor/pg_loss"]),
            "fused_function_calls": len(fused_calls)}


def run_one(spec: dict, config: str) -> dict:
    args = [sys.executable, __file__, "--worker", json.dumps({**spec, "port": _free_port()}), config]
    proc = subprocess.run(args, capture_output=True, text=True, env={**os.environ, "GRPO_PATCHES": ""})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker failed: {proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def summarise(samples: dict) -> list[dict]:
    med = {c: {k: statistics.median(s[k] for s in samples[c]) for k in ("time_s", "peak_added_mb")} for c in CONFIGS}
    rows = []
    for c in CONFIGS:
        rows.append({"config": c, **med[c], "time_vs_fused": med[c]["time_s"] / med["fused"]["time_s"],
                     "time_vs_dense": med[c]["time_s"] / med["dense"]["time_s"],
                     "peak_vs_fused": med[c]["peak_added_mb"] / med["fused"]["peak_added_mb"],
                     "peak_vs_dense": med[c]["peak_added_mb"] / med["dense"]["peak_added_mb"],
                     "pg_loss": samples[c][0]["pg_loss"], "fused_function_calls": samples[c][0]["fused_function_calls"], "all_time_s": [s["time_s"] for s in samples[c]],
                     "all_peak_added_mb": [s["peak_added_mb"] for s in samples[c]]})
    return rows


def table(rows: list[dict]) -> str:
    head = (f"{'config':>6} {'time s':>8} {'vs fused':>9} {'vs dense':>9} {'peak +MB':>9} {'vs fused':>9} "
            f"{'vs dense':>9} {'pg_loss':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['config']:>6} {r['time_s']:>8.2f} {r['time_vs_fused']:>8.2f}x {r['time_vs_dense']:>8.2f}x "
                     f"{r['peak_added_mb']:>9.0f} {r['peak_vs_fused']:>8.2f}x {r['peak_vs_dense']:>8.2f}x "
                     f"{r['pg_loss']:>10.6f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a small model, 1 repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(json.loads(args.worker[0]), args.worker[1])), flush=True)
        return
    spec = {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "rows": args.rows, "prompt": 32,
            "response": 96, "micro": 8, "threads": 2}
    if args.quick:
        spec.update(hidden=64, vocab=4096, response=32)
        args.repeats = 1
    from importlib import metadata

    samples: dict = {c: [] for c in CONFIGS}
    for repeat in range(args.repeats):  # round-robin: every configuration once per repeat
        for config in CONFIGS:
            result = run_one(spec, config)
            samples[config].append(result)
            print(f"repeat {repeat} {config}: {result['time_s']:.2f} s, +{result['peak_added_mb']:.0f} MB", flush=True)
    rows = summarise(samples)
    print(table(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.date.today().isoformat(), "verl": metadata.version("verl"),
            "torch": metadata.version("torch"), "spec": spec, "repeats": args.repeats, "cpu_count": os.cpu_count()}
    (args.out / "verl_tiled_loss.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out / 'verl_tiled_loss.json'}")


if __name__ == "__main__":
    main()
