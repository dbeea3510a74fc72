"""The same GRPO workload through every installed framework, patches off and on, side by side.

    bash scripts/run frameworks                  # the newest installed version of each framework, 5 rounds
    bash scripts/run frameworks --quick          # smoke run: smaller model, fewer steps, 1 round
    bash scripts/run frameworks --mini-batches 4 --variable-lengths   # 4 optimizer steps per rollout batch
    bash scripts/run frameworks --frameworks verl --python verl=compat/.nox/cpu-verl-0-7-1/bin/python

(``python benchmarks/frameworks.py ...`` runs the same: started by a Python without the
project's packages it re-runs itself with ``.venv``'s, and says how to make that one.)

The workload (``workload.py``): one tiny Qwen2, the same prompts and reward (75 % of rows with
advantage exactly 0), SGD. Each framework runs its own trainer code on it (``fw_<name>.py``
says which) in its own interpreter, one process per run; runs go round-robin (round 1: every
framework off then on, round 2, ...) so a slow phase of this shared machine hits every run
alike. Reported per framework: trainer-side seconds per optimizer step (generation excluded,
reported apart; median over timed steps, then over rounds) and the patched/unpatched ratio of
the same round (median), old-logprob and reference passes, rows dropped from the update, peak
RSS, the largest final-weight difference patched vs unpatched, the rows the old-logprob passes
computed and the tokens through the policy forward (off → on, where the runner counts them). ``--verify`` adds, for
NeMo-RL, a patched run with ``verify_every=1`` to each round: the cost of a verify step against a
normal patched step (trainer side, same round, median) and verify mode's largest figures. Writes ``frameworks.md``,
``frameworks.json`` and ``frameworks.png`` (one panel per metric) to ``--out-dir``.

Interpreters (``_interpreters.py``): ``--python NAME=PATH``, else ``$GRPO_BENCH_PYTHON_<NAME>``,
else the newest version of the framework that the adapter supports and the runner runs, among
this interpreter (the project's ``.venv``) and the compat venvs (``compat/.nox/``, made by
``bash scripts/run compat [TAG]``); each run's interpreter and where it came from are printed
and written into the report. NeMo-RL runs from the clones in ``$NEMO_RL_SRC`` /
``$AUTOMODEL_SRC``: a tag (``--nemo-rl-tag``, else ``$NEMO_RL_TAG``, else the newest the
runner runs that has an interpreter) is exported from them by compat/sources.py onto its
``PYTHONPATH``; its interpreter is that tag's compat venv (``NEMO_RL_SRC=... AUTOMODEL_SRC=...
bash scripts/run compat nemo_rl --install-only`` makes them); open-instruct likewise from ``$OPEN_INSTRUCT_SRC``
(``--open-instruct-tag``; its cells' venvs, or ``GRPO_BENCH_PYTHON_OPEN_INSTRUCT``). A framework that is not
found becomes a "not run" row with the reason.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import _frameworks_report as report  # noqa: E402
import _interpreters as interpreters  # noqa: E402
import workload  # noqa: E402
from _frameworks_summary import summarise  # noqa: E402,F401  (frameworks.summarise: the tests use it)

#: Runners that take ``spec["verify_every"]`` (``--verify``; TRL's verify cost: ``trl_step.py --verify``).
VERIFY_RUNNERS = ("nemo_rl",)
FRAMEWORKS = {"trl": "trl", "verl": "verl", "verl_v1": "verl", "nemo_rl": "nemo_rl",
              "open_instruct": "open_instruct"}  # name -> module the interpreter must import
#: A runner's adapter when it is another name's (verl_v1: verl 0.9+ through main_ppo).
ADAPTERS = {"verl_v1": "verl"}
#: What this process needs itself (the runs have their own interpreters): the project's packages.
OWN_NEEDS = ("grpo_patches", "torch", "tqdm", "packaging")
DEFAULTS = {"rounds": 5, "timeout": 1800, "out_dir": HERE / "results"}


def ensure_project_interpreter(python: str = sys.executable) -> None:
    """Re-run with the project's ``.venv`` when this Python lacks :data:`OWN_NEEDS`; without one,
    exit saying how to make it."""
    missing = [m for m in OWN_NEEDS if importlib.util.find_spec(m) is None]
    if not missing:
        return
    venv = ROOT / ".venv" / "bin" / "python"
    if venv.exists() and os.path.abspath(python) != str(venv) and not os.environ.get("GRPO_BENCH_REEXEC"):
        print(f"frameworks.py: {python} lacks {', '.join(missing)}: running with {interpreters.shown(venv)}",
              file=sys.stderr, flush=True)
        os.execve(str(venv), [str(venv), __file__, *sys.argv[1:]], {**os.environ, "GRPO_BENCH_REEXEC": "1"})
    raise SystemExit(f"frameworks.py needs the project's environment ({', '.join(missing)} missing here): run it as "
                     "`bash scripts/run frameworks [args]`, which creates .venv on first use")


def matrix_tags(name: str) -> list[tuple[str, str]]:
    """A clone-run framework's tags in the compat matrix with the version the adapter reads from each, newest first."""
    from packaging.version import Version

    sys.path.insert(0, str(ROOT / "compat"))
    import matrix

    cells = [c for c in matrix.load() if c.framework == name]
    return sorted(((c.version, c.adapter_version) for c in cells), key=lambda t: Version(t[1]), reverse=True)


def find_python(name: str, given: dict[str, str], tag: str | None = None) -> tuple[Any, str]:
    """The interpreter for ``name`` (an :class:`_interpreters.Interpreter`, or None) and where it
    came from (or why there is none). The chosen one must import grpo_patches and the framework.
    ``tag``: a clone-run framework's tag (``--nemo-rl-tag``, ``--open-instruct-tag``)."""
    from grpo_patches import registry

    variable = interpreters.SOURCE_CHECKOUTS.get(name)
    if variable and not os.environ.get(variable):
        extra = " (and AUTOMODEL_SRC)" if name == "nemo_rl" else ""
        return None, f"no {report.NAMES.get(name, name)} checkout: set {variable}{extra} to a clone (compat/README.md)"
    pool = interpreters.candidates(name, given, matrix_tags(name) if variable else [], tag, ROOT)
    reasons = []
    while True:
        chosen, why = interpreters.choose(name, pool, registry.get(ADAPTERS.get(name, name)).supported)
        if chosen is None:
            return None, "; ".join([*reasons, why])
        check = subprocess.run([chosen.python, "-c", f"import grpo_patches, {FRAMEWORKS[name]}"], capture_output=True,
                               text=True, env=_env(name, chosen.tag), cwd=HERE)
        if check.returncode == 0:
            return chosen, chosen.origin
        last = check.stderr.strip().splitlines()[-1] if check.stderr.strip() else "fails"
        reasons.append(f"{name} {chosen.version} in {chosen.origin} does not import: {last}")
        pool = [c for c in pool if c is not chosen]


def _env(name: str | None = None, tag: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GRPO_PATCHES", "GRPO_PATCHES_OPTIONS")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    source = _source_path(name, tag)
    if source:
        env["PYTHONPATH"] = os.pathsep.join(source + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _source_path(name: str | None, tag: str | None) -> list[str]:
    """``PYTHONPATH`` entries of a framework run from a source checkout (the tag's export)."""
    variable = interpreters.SOURCE_CHECKOUTS.get(name or "")
    if variable is None or tag is None or not os.environ.get(variable):
        return []
    sys.path.insert(0, str(ROOT / "compat"))
    import matrix
    import sources

    cell = next((c for c in matrix.load() if c.framework == name and c.version == tag), None)
    if cell is None:
        raise SystemExit(f"{tag}: not a {report.NAMES.get(name, name)} tag of compat/matrix.toml")
    return [str(p) for p in sources.prepare_source(cell)]


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def run_one(python: Any, name: str, patched: bool, spec: dict, weights: Path, timeout: int) -> dict[str, Any]:
    """One run in ``python`` (an :class:`_interpreters.Interpreter`)."""
    args = [python.python, str(HERE / "_framework_worker.py"), name, str(int(patched)), json.dumps(spec), str(weights)]
    env = {**_env(name, python.tag), "MASTER_PORT": _port(), "OMP_NUM_THREADS": str(spec["threads"])}
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bash scripts/run frameworks", description=__doc__.split("\n")[0] + (
        " Each framework runs in the interpreter holding the newest version its adapter supports and its runner "
        "runs, among the project's .venv and the compat venvs (compat/.nox/), unless --python names one."))
    p.add_argument("--frameworks", nargs="+", choices=list(FRAMEWORKS), default=list(FRAMEWORKS),
                   help="which frameworks (default: all of them: trl, verl (legacy line), verl_v1 (main_ppo), nemo_rl, "
                        "open_instruct; those without an interpreter become 'not run' rows)")
    p.add_argument("--python", nargs="+", default=[], metavar="NAME=PATH",
                   help="a framework's interpreter, e.g. verl=compat/.nox/cpu-verl-0-7-1/bin/python (default: "
                        "$GRPO_BENCH_PYTHON_<NAME>, else the newest supported version found)")
    p.add_argument("--rounds", type=int, default=DEFAULTS["rounds"],
                   help=f"round-robin repetitions; medians over them (default: {DEFAULTS['rounds']}, the README's run)")
    p.add_argument("--steps", type=int, default=workload.SPEC["steps"],
                   help=f"optimizer steps per run, the first {workload.SPEC['warmup']} untimed "
                        f"(default: {workload.SPEC['steps']})")
    p.add_argument("--quick", action="store_true", help="smoke run: smaller model, fewer steps, 1 round")
    p.add_argument("--mini-batches", type=int, default=workload.SPEC["mini_batches"], metavar="N",
                   help="optimizer steps per rollout batch (TRL: steps_per_generation / gradient_accumulation_steps; "
                        "verl: ppo_mini_batch_size = batch / N; NeMo-RL: train_global_batch_size = rollout / N); "
                        f"--steps then counts rollout batches (default: {workload.SPEC['mini_batches']})")
    p.add_argument("--variable-lengths", action="store_true",
                   help="prompts of 2-8 words and a tiny model that ends completions early (varied lengths: "
                        "padding for the kept rows to skip; default: 4-word prompts, completions mostly full length)")
    p.add_argument("--timeout", type=int, default=DEFAULTS["timeout"],
                   help=f"seconds per run before it counts as failed (default: {DEFAULTS['timeout']})")
    p.add_argument("--out-dir", type=Path, default=DEFAULTS["out_dir"],
                   help=f"where frameworks.{{md,json,png}} go (default: {interpreters.shown(DEFAULTS['out_dir'])})")
    p.add_argument("--pack", action="store_true",
                   help="TRL: the patched runs also pack the kept rows into full micro-batches (pack_kept_rows=True)")
    p.add_argument("--verify", action="store_true",
                   help="NeMo-RL: add a patched run with verify_every=1 to each round (every step a verify step) and "
                        "report the cost of a verify step against a normal patched one (same round, median)")
    p.add_argument("--nemo-rl-tag", default=os.environ.get("NEMO_RL_TAG"),
                   help="the NeMo-RL tag to export from $NEMO_RL_SRC (default: $NEMO_RL_TAG, else the newest tag "
                        "the runner runs that has an interpreter)")
    p.add_argument("--open-instruct-tag", default=os.environ.get("OPEN_INSTRUCT_TAG"),
                   help="the open-instruct ref to export from $OPEN_INSTRUCT_SRC (default: $OPEN_INSTRUCT_TAG, else "
                        "the newest the matrix has an interpreter for)")
    args = p.parse_args(argv)
    given = {name: os.path.abspath(path) for name, path in (item.split("=", 1) for item in args.python)}
    spec = {**workload.SPEC, **(workload.QUICK if args.quick else {})}
    if args.steps != workload.SPEC["steps"]:
        spec["steps"] = args.steps
    if args.mini_batches < 1 or spec["prompts"] % args.mini_batches:
        p.error(f"--mini-batches {args.mini_batches}: must divide the {spec['prompts']} prompts of a rollout batch")
    spec.update(mini_batches=args.mini_batches, variable_lengths=args.variable_lengths, pack_kept_rows=args.pack)
    rounds = 1 if args.quick else args.rounds
    tags = {"nemo_rl": args.nemo_rl_tag, "open_instruct": args.open_instruct_tag}
    pythons = {name: find_python(name, given, tags.get(name)) for name in args.frameworks}
    for name, (python, origin) in pythons.items():
        print(f"{name}: {python.version} from {origin}" if python else f"{name}: not run: {origin}", flush=True)
    active = [name for name, (python, _) in pythons.items() if python]
    runs: dict[str, list] = {name: [] for name in active}
    verified: dict[str, list] = {name: [] for name in active}
    from tqdm import tqdm

    with tempfile.TemporaryDirectory(prefix="grpo_bench_") as tmp, \
            tqdm(total=rounds * len(active) * 2, unit="run", desc="frameworks") as bar:  # (--verify: not counted)
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
                if args.verify and name in VERIFY_RUNNERS:
                    bar.set_postfix_str(f"round {r + 1} {name} on, verify_every=1")
                    verified[name].append(run_one(pythons[name][0], name, True, {**spec, "verify_every": 1},
                                                  Path(tmp, f"{name}-2.pt"), args.timeout))
    rows = [summarise(name, spec, runs[name], verified[name]) for name in active]
    rows += [{"framework": name, "status": f"not run: {origin}"} for name, (py, origin) in pythons.items() if not py]
    meta = {"date": datetime.date.today().isoformat(), "spec": spec, "rounds": rounds, "workload": workload.describe(spec),
            "cpu_count": os.cpu_count(), "command": command_line(argv if argv is not None else sys.argv[1:]),
            "interpreters": {name: f"{report.NAMES.get(name, name)} {py.tag or py.version}: {origin}"
                             for name, (py, origin) in pythons.items() if py}}
    print(report.write(args.out_dir, meta, rows))
    return 0 if all(r["status"] == "ok" or r["status"].startswith("not run") for r in rows) else 1


def command_line(argv: list[str]) -> str:
    """The command as a reader can repeat it: paths inside the checkout relative to it, none outside."""
    def portable(arg: str) -> str:
        name, sep, value = arg.rpartition("=")
        if value.startswith(("/", "~")) or os.sep in value:
            value = interpreters.shown(os.path.expanduser(value))
        return f"{name}{sep}{value}"

    variables = " ".join(f"{v}=<clone>" for v in ("NEMO_RL_SRC", "AUTOMODEL_SRC", "OPEN_INSTRUCT_SRC", "OLMO_CORE_SRC")
                         if os.environ.get(v))
    return " ".join(filter(None, [variables, "bash scripts/run frameworks", *map(portable, argv)]))


if __name__ == "__main__":
    ensure_project_interpreter()
    sys.exit(main())
