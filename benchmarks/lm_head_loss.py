"""Benchmark: lm-head + GRPO loss, fwd+bwd, dense torch vs grpo_patches' tiled loss vs installed peers.

Each (config, implementation) runs in its own subprocess (``_worker.py``) so its peak memory is clean.
Per config a reference subprocess first computes, with dense fp32 torch, the old log-probs every
implementation uses and the loss/gradients every implementation is compared with (saved to a
temporary .pt). Prints a table and the issue's targets; writes JSON and a PNG chart to --out-dir.

    python benchmarks/lm_head_loss.py --quick                  # smoke test, seconds
    python benchmarks/lm_head_loss.py                          # full: 4096 tokens, H 1024, V 32000/151936
    python benchmarks/lm_head_loss.py --vocab 32000 --impl dense project --repeats 5
    python benchmarks/lm_head_loss.py --rounds 3 --impl dense project baseline --baseline-src .cache/main

``--rounds`` repeats the whole sequence of implementations round-robin (each round one process per
implementation); a row's "x dense" is then the median over rounds of its time / dense's time in the
same round, which is what a shared, busy machine can still measure. ``baseline`` is the project's
tiled loss imported from another source tree (``--baseline-src``, e.g. ``git archive main grpo_patches
adapters | tar -x -C .cache/main``): a before/after comparison in one run. Peers that are not installed (or cannot run here) become
"not installed (...)" rows.
"""

from __future__ import annotations

import argparse
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
sys.path.insert(0, str(HERE))
from _report import check_targets, enrich, floor_bytes, format_table, write_chart, write_json  # noqa: E402

IMPLS = ("dense", "project", "baseline", "liger", "trl", "deepspeed")
PEERS = ("liger", "trl", "deepspeed")
QUICK = {"tokens": 512, "hidden": 128, "vocab": [1000, 3001], "rows": 4, "tile": 128, "repeats": 3}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[32000, 151936], help="vocab sizes (list)")
    p.add_argument("--tokens", type=int, default=4096, help="N, tokens per call")
    p.add_argument("--hidden", type=int, default=1024, help="H, hidden size")
    p.add_argument("--rows", type=int, default=8, help="sequences the tokens form (Liger chunks by row)")
    p.add_argument("--tile", type=int, default=512,
                   help="tokens per tile for the floor and for DeepSpeed's shards (Liger: tokens/rows)")
    p.add_argument("--min-keep", type=float, default=1.0,
                   help="each row keeps a random prefix of >= this fraction of its tokens unmasked (1.0: no "
                        "padding, every implementation does the same work; <1 shows skipping of masked tokens)")
    p.add_argument("--project-tile", type=int, default=None,
                   help="pass tile_size to the project (default: its own choice from its memory budget)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per implementation (median)")
    p.add_argument("--rounds", type=int, default=1,
                   help="round-robin rounds over the implementations (x dense: median of the per-round ratios)")
    p.add_argument("--baseline-src", type=Path, default=None,
                   help="source tree whose grpo_patches the 'baseline' impl imports (e.g. a checkout of main)")
    p.add_argument("--project-tile-memory", type=int, default=None,
                   help="pass tile_memory_bytes to the project (and baseline)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first")
    p.add_argument("--impl", nargs="+", choices=IMPLS, default=list(IMPLS), help="subset of implementations")
    p.add_argument("--dtype", nargs="+", default=None,
                   help="dtypes; default float32 on CPU, plus bfloat16 on CUDA when available")
    p.add_argument("--device", nargs="+", default=None, help="devices; default cpu, plus cuda when available")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in every subprocess")
    p.add_argument("--no-liger-compile", action="store_true", help="Liger with compiled=False")
    p.add_argument("--out-dir", type=Path, default=HERE / "results")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=3600, help="seconds per subprocess")
    p.add_argument("--quick", action="store_true", help=f"small shape smoke test: {QUICK}")
    if p.parse_known_args(argv)[0].quick:  # small defaults; flags given explicitly still win
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    if "baseline" in args.impl and args.baseline_src is None:
        if argv is None and "--impl" not in sys.argv:
            args.impl = [i for i in args.impl if i != "baseline"]  # the default list: no baseline without a tree
        else:
            p.error("--impl baseline needs --baseline-src DIR (a source tree with grpo_patches/)")
    if args.tokens % args.rows:
        p.error(f"--tokens {args.tokens} must be a multiple of --rows {args.rows}")
    return args


def configs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(device, dtype) pairs: fp32 on CPU, and bf16 on CUDA when a GPU is present (unless given)."""
    import torch  # only to detect CUDA; the measurements run in subprocesses

    cuda = torch.cuda.is_available()
    devices = args.device or (["cpu", "cuda"] if cuda else ["cpu"])
    pairs = []
    for device in devices:
        for dtype in args.dtype or (["bfloat16"] if device == "cuda" else ["float32"]):
            pairs.append((device, dtype))
    return pairs


def run_job(spec: dict, tmp: Path, timeout: int, baseline_src: Path | None = None) -> dict:
    spec = dict(spec, result_path=str(tmp / f"result_{spec['impl']}.json"))
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    if spec["impl"] == "baseline":  # its grpo_patches comes first on the path
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(baseline_src.resolve()), env.get("PYTHONPATH")]))
    Path(spec["result_path"]).unlink(missing_ok=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(HERE / "_worker.py"), json.dumps(spec)], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": f"error: timed out after {timeout}s"}
    result_file = Path(spec["result_path"])
    if not result_file.exists():  # killed (e.g. out of memory) before writing a result
        tail = (proc.stderr or "").strip().splitlines()[-3:]
        return {"status": f"error: exit {proc.returncode}: {' | '.join(tail)}"[:300]}
    result = json.loads(result_file.read_text())
    result["wall_s"] = time.perf_counter() - t0
    if result["status"].startswith("error") and proc.stderr:
        print(proc.stderr[-2000:], file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    impls = [i for i in IMPLS if i in args.impl]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="lm_head_bench_") as tmp_name:
        tmp = Path(tmp_name)
        for device, dtype in configs(args):
            for vocab in args.vocab:
                config = f"V={vocab} {dtype} {device}"
                base = {"tokens": args.tokens, "hidden": args.hidden, "vocab": vocab, "rows": args.rows,
                        "min_keep": args.min_keep, "tile": args.tile, "project_tile": args.project_tile,
                        "project_tile_memory": args.project_tile_memory,
                        "repeats": args.repeats, "warmup": args.warmup, "threads": args.threads,
                        "seed": args.seed, "device": device,
                        "dtype": dtype, "liger_compiled": not args.no_liger_compile,
                        "ref_path": str(tmp / f"ref_{device}_{dtype}_{vocab}.pt")}
                print(f"[{config}] reference (dense fp32: old log-probs, loss, grads) ...", flush=True)
                ref = run_job(dict(base, impl="reference"), tmp, args.timeout)
                if ref["status"] != "ok":
                    print(f"[{config}] reference failed: {ref['status']}", file=sys.stderr)
                    return 1
                per_round = {impl: [] for impl in impls}
                for r in range(args.rounds):
                    for impl in impls:
                        print(f"[{config}] round {r + 1}/{args.rounds} {impl} ...", end=" ", flush=True)
                        res = run_job(dict(base, impl=impl), tmp, args.timeout, args.baseline_src)
                        print(res["status"] if res["status"] != "ok" else f"{res['time_median_s']:.2f} s", flush=True)
                        per_round[impl].append(res)
                for impl in impls:
                    rows.append({"impl": impl, "config": config, "vocab": vocab, "dtype": dtype, "device": device,
                                 "floor_bytes": floor_bytes(args.tokens, args.hidden, vocab, args.tile),
                                 **merge_rounds(per_round[impl], per_round.get("dense"))})
    enrich(rows)
    table = format_table(rows)
    targets = check_targets(rows, PEERS)
    shape = f"N={args.tokens} H={args.hidden} rows={args.rows} min_keep={args.min_keep} floor tile={args.tile}"
    print(f"\nlm-head GRPO loss, fwd+bwd ({shape}, {args.threads} threads, median of {args.repeats}"
          f"{f' per round, {args.rounds} rounds round-robin' if args.rounds > 1 else ''}; peak = extra over inputs; "
          "grad diff = max |grad - dense fp32 grad|)")
    print(table)
    print("\nTargets (project):")
    print("\n".join("  " + line for line in targets))
    stem = "lm_head_loss_quick" if args.quick else "lm_head_loss"
    meta = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "python": sys.executable, "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "versions": _versions()}
    write_json(args.out_dir / f"{stem}.json", meta, rows, targets)
    write_chart(args.out_dir / f"{stem}.png", rows, f"lm-head GRPO loss fwd+bwd, {shape}")
    print(f"\nwrote {args.out_dir / (stem + '.json')} and {args.out_dir / (stem + '.png')}")
    return 0


def merge_rounds(results: list[dict], dense: list[dict] | None) -> dict:
    """One row from an implementation's rounds: median time over rounds, max peak, and ``round_ratios``
    (its time / dense's in the same round) whose median becomes "x dense"."""
    ok = [r for r in results if r["status"] == "ok"]
    if not ok:
        return results[-1]
    row = dict(ok[-1])
    row["time_median_s"] = statistics.median(r["time_median_s"] for r in ok)
    row["times_s"] = [t for r in ok for t in r["times_s"]]
    row["peak_extra_bytes"] = max(r["peak_extra_bytes"] for r in ok)
    row["max_grad_diff"] = max(r["max_grad_diff"] for r in ok)
    if dense:
        row["round_ratios"] = [r["time_median_s"] / d["time_median_s"] for r, d in zip(results, dense)
                               if r["status"] == "ok" and d["status"] == "ok"]
    return row


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("torch", "trl", "liger-kernel", "deepspeed", "grpo-patches", "triton"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


if __name__ == "__main__":
    sys.exit(main())
