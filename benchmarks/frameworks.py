"""The same GRPO workload through every installed framework, patches off and on, side by side.

    python benchmarks/frameworks.py                   # every framework found, 3 rounds (the README numbers)
    python benchmarks/frameworks.py --quick           # smoke run: smaller model, fewer steps, 1 round
    python benchmarks/frameworks.py --python verl=/path/to/venv/bin/python --frameworks verl

The workload (``workload.py``): one tiny Qwen2, the same prompts and reward (75 % of rows with
advantage exactly 0), SGD. Each framework runs its own trainer code on it (``fw_<name>.py``
says which) in its own interpreter, one process per run; runs go round-robin (round 1: every
framework off then on, round 2, ...) so a slow phase of this shared machine hits every run
alike. Reported per framework: trainer-side seconds per optimizer step (generation excluded,
reported apart; median over timed steps, then over rounds) and the patched/unpatched ratio of
the same round (median), old-logprob and reference passes, rows dropped from the update, peak
RSS, and the largest final-weight difference patched vs unpatched. Writes ``frameworks.md``,
``frameworks.json`` and ``frameworks.png`` (one panel per metric) to ``--out-dir``.

A framework's interpreter is ``--python NAME=PATH``, else ``$GRPO_BENCH_PYTHON_<NAME>``, else
its newest compat venv (``compat/.nox/cpu-<name>-*``, made by ``bash scripts/run compat
<name> --install-only``), else (TRL only) this interpreter. NeMo-RL runs from the checkouts
in ``$NEMO_RL_SRC`` / ``$AUTOMODEL_SRC``: the tag ``--nemo-rl-tag`` (else ``$NEMO_RL_TAG``, else
v0.6.0) is exported from them by compat/sources.py and put on its ``PYTHONPATH``; give the
interpreter that tag needs (a v0.6.0 Python 3.11 venv, a v0.7.0 / main Python 3.13 one). A
framework that is not found becomes a "not run" row with the reason.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import _frameworks_report as report  # noqa: E402
import workload  # noqa: E402

FRAMEWORKS = {"trl": "trl", "verl": "verl", "verl_v1": "verl", "nemo_rl": "nemo_rl"}  # name -> module the interpreter must import
VENVS = {"verl_v1": "verl"}  # a runner's compat venvs when they are another name's (verl_v1: verl 0.9+ through main_ppo)


def find_python(name: str, given: dict[str, str]) -> tuple[str | None, str]:
    """The interpreter for ``name`` and where it came from (or None and why not)."""
    candidates = []
    if name in given:
        candidates.append((given[name], "--python"))
    if os.environ.get(f"GRPO_BENCH_PYTHON_{name.upper()}"):
        candidates.append((os.environ[f"GRPO_BENCH_PYTHON_{name.upper()}"], f"$GRPO_BENCH_PYTHON_{name.upper()}"))
    venvs = sorted(ROOT.glob(f"compat/.nox/cpu-{VENVS.get(name, name).replace('_', '-')}-*/bin/python"),
                   key=lambda p: [int(x) if x.isdigit() else x for x in p.parent.parent.name.split("-")])
    candidates += [(str(p), "compat venv") for p in reversed(venvs)]
    if name == "trl":
        candidates.append((sys.executable, "this interpreter"))
    why = "no interpreter (give --python, $GRPO_BENCH_PYTHON_<NAME>, or make its compat venv)"
    for python, origin in candidates:
        try:
            probe = subprocess.run([python, "-c", f"import grpo_patches, {FRAMEWORKS[name]}"], capture_output=True,
                                   text=True, env=_env(name), cwd=HERE)
        except OSError as e:
            why = f"{python} ({origin}): {e.strerror}"
            continue
        if probe.returncode == 0:
            return python, origin
        why = f"{python} ({origin}): {probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else 'fails'}"
    return None, why


def _env(name: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GRPO_PATCHES", "GRPO_PATCHES_OPTIONS")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    source = _source_path(name)
    if source:
        env["PYTHONPATH"] = os.pathsep.join(source + [p for p in [env.get("PYTHONPATH")] if p])
    return env


NEMO_RL_TAG = os.environ.get("NEMO_RL_TAG", "v0.6.0")  # --nemo-rl-tag


def _source_path(name: str | None) -> list[str]:
    """``PYTHONPATH`` entries of a framework run from a source checkout (NeMo-RL: the tag's export)."""
    if name != "nemo_rl" or not os.environ.get("NEMO_RL_SRC"):
        return []
    sys.path.insert(0, str(ROOT / "compat"))
    import matrix
    import sources

    cell = next((c for c in matrix.load() if c.framework == name and c.version == NEMO_RL_TAG), None)
    if cell is None:
        raise SystemExit(f"--nemo-rl-tag {NEMO_RL_TAG}: not a NeMo-RL tag of compat/matrix.toml")
    return [str(p) for p in sources.prepare_source(cell)]


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run_one(python: str, name: str, patched: bool, spec: dict, weights: Path, timeout: int) -> dict[str, Any]:
    args = [python, str(HERE / "_framework_worker.py"), name, str(int(patched)), json.dumps(spec), str(weights)]
    env = {**_env(name), "MASTER_PORT": _port(), "OMP_NUM_THREADS": str(spec["threads"])}
    try:
        proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=HERE, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}
    return json.loads(lines[-1][len("RESULT "):])


def weight_diff(a: Path, b: Path) -> float:
    import torch

    x, y = torch.load(a), torch.load(b)
    return max(float((x[k].float() - y[k].float()).abs().max()) for k in x)


def summarise(name: str, spec: dict, runs: list[tuple[dict, dict, float | None]]) -> dict[str, Any]:
    """One row per framework from its (off, on, weight diff) rounds."""
    ok = [(off, on, d) for off, on, d in runs if "error" not in off and "error" not in on]
    skipped = next((r["not_run"] for pair in runs for r in pair[:2] if "not_run" in r), None)
    if skipped:
        return {"framework": name, "status": f"not run: {skipped}"}
    if not ok:
        errors = [r["error"] for pair in runs for r in pair[:2] if "error" in r]
        return {"framework": name, "status": "failed: " + (errors[0] if errors else "no run")}

    def per_step(run: dict, key: str) -> float:
        return statistics.median(s[key] for s in run["steps"][spec["warmup"]:] or run["steps"])

    off_last, on_last = ok[-1][0], ok[-1][1]
    return {
        "framework": name, "status": "ok", "version": off_last["version"], "line": off_last["line"],
        "trainer_side_off_s": statistics.median(per_step(off, "trainer_side") for off, _, _ in ok),
        "trainer_side_on_s": statistics.median(per_step(on, "trainer_side") for _, on, _ in ok),
        "ratio": statistics.median(per_step(on, "trainer_side") / per_step(off, "trainer_side") for off, on, _ in ok),
        "ratio_cpu": (statistics.median(per_step(on, "cpu_trainer_side") / per_step(off, "cpu_trainer_side")
                                        for off, on, _ in ok) if "cpu_trainer_side" in off_last["steps"][0] else None),
        "generation_s": statistics.median(per_step(r, "generation") for pair in ok for r in pair[:2]),
        "old_logprob_passes": [off_last["old_logprob_passes"], on_last["old_logprob_passes"]],
        "reference_passes": [off_last["reference_passes"], on_last["reference_passes"]],
        "rows_dropped": on_last["rows_dropped"], "rows_total": on_last["rows_total"],
        "peak_rss_mb": [statistics.median(off["peak_rss_mb"] for off, _, _ in ok),
                        statistics.median(on["peak_rss_mb"] for _, on, _ in ok)],
        "max_weight_diff": max(d for _, _, d in ok if d is not None),
        "rounds": len(ok),
        "trainer_side_all_s": [[per_step(off, "trainer_side"), per_step(on, "trainer_side")] for off, on, _ in ok],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frameworks", nargs="+", choices=list(FRAMEWORKS), default=list(FRAMEWORKS))
    p.add_argument("--python", nargs="+", default=[], metavar="NAME=PATH", help="a framework's interpreter")
    p.add_argument("--rounds", type=int, default=3, help="round-robin repetitions (median)")
    p.add_argument("--steps", type=int, help=f"optimizer steps per run (default {workload.SPEC['steps']})")
    p.add_argument("--quick", action="store_true", help="smaller model, fewer steps, 1 round")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--out-dir", type=Path, default=HERE / "results")
    p.add_argument("--nemo-rl-tag", default=NEMO_RL_TAG, help="NeMo-RL tag to export from $NEMO_RL_SRC")
    args = p.parse_args(argv)
    globals()["NEMO_RL_TAG"] = args.nemo_rl_tag
    given = {name: os.path.abspath(path) for name, path in (item.split("=", 1) for item in args.python)}
    spec = {**workload.SPEC, **(workload.QUICK if args.quick else {})}
    if args.steps:
        spec["steps"] = args.steps
    rounds = 1 if args.quick else args.rounds
    pythons = {name: find_python(name, given) for name in args.frameworks}
    for name, (python, origin) in pythons.items():
        print(f"{name}: {python} ({origin})" if python else f"{name}: not run: {origin}", flush=True)
    active = [name for name, (python, _) in pythons.items() if python]
    runs: dict[str, list] = {name: [] for name in active}
    from tqdm import tqdm

    with tempfile.TemporaryDirectory(prefix="grpo_bench_") as tmp, \
            tqdm(total=rounds * len(active) * 2, unit="run", desc="frameworks") as bar:
        for r in range(rounds):
            for name in active:
                pair = []
                for patched in (False, True):
                    bar.set_postfix_str(f"round {r + 1} {name} {'on' if patched else 'off'}")
                    pair.append(run_one(pythons[name][0], name, patched, spec, Path(tmp, f"{name}-{int(patched)}.pt"),
                                        args.timeout))
                    bar.update()
                diff = None if any("error" in x or "not_run" in x for x in pair) else weight_diff(Path(tmp, f"{name}-0.pt"),
                                                                                 Path(tmp, f"{name}-1.pt"))
                runs[name].append((*pair, diff))
    rows = [summarise(name, spec, runs[name]) for name in active]
    rows += [{"framework": name, "status": f"not run: {origin}"} for name, (py, origin) in pythons.items() if not py]
    meta = {"date": datetime.date.today().isoformat(), "spec": spec, "rounds": rounds, "workload": workload.describe(spec),
            "cpu_count": os.cpu_count(), "command": " ".join(["python benchmarks/frameworks.py", *(argv or sys.argv[1:])])}
    print(report.write(args.out_dir, meta, rows))
    return 0 if all(r["status"] == "ok" or r["status"].startswith("not run") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
