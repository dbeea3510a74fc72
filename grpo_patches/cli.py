"""Command line: ``grpo-patches status`` (a table, or ``--json``), ``grpo-patches demo``, and the
start-up path for Ray workers: ``grpo-patches run -- python train.py ...`` / ``grpo-patches env``."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from typing import Any, Sequence

from grpo_patches import __version__

#: ``grpo-patches --help``'s description (plain text: the module docstring is reStructuredText).
DESCRIPTION = ("Exact optimizations for GRPO training in TRL, verl and NeMo-RL. Patch a framework in Python with "
               "grpo_patches.enable(\"trl\"), or in every process with GRPO_PATCHES=trl; this command reports what is "
               "patched, runs the demo, and starts processes (Ray workers included) with the patches.")


def format_status(report: dict[str, dict[str, Any]]) -> str:
    """Render :func:`grpo_patches.status` as a plain-text table plus notes and savings."""
    header = ("framework", "installed", "supported range", "supported", "patched", "options")
    rows = [header]
    details: list[str] = []
    for name, entry in report.items():
        supported = "yes" if entry["supported"] else f"no ({entry['reason']})"
        patched = {(True, False): "yes", (False, True): "on import (see below)",
                   (True, True): "yes, more on import (see below)"}.get((entry["patched"], entry["pending_import"]), "no")
        options = entry["options"]
        shown = ", ".join(f"{k}={v}" for k, v in options.items()) if options else "-"
        rows.append((name, entry["installed"] or "-", entry["supported_range"], supported, patched, shown))
        if entry.get("version_origin"):
            details.append(f"  {name}: version: {entry['version_origin']}")
        if entry.get("error"):
            details.append(f"  {name}: error: {entry['error']}")
        if entry.get("pending_import"):
            details.append(f"  {name}: {entry['summary']}")
        for record in entry.get("patches", []):
            if record["state"] not in ("applied", "pending import"):  # those waiting: the summary above
                details.append(f"  {name}: {record['target']}: {record['state']}")
        for key, text in entry["notes"].items():
            details.append(f"  {name}: {key}: {text}")
        for klass, notes in entry.get("by_class", {}).items():
            for key, text in notes.items():
                details.append(f"  {name} [{klass}]: {key}: {text}")
        for key, value in sorted(entry["savings"].items()):
            details.append(f"  {name}: saved {key} = {value:g}")
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if details:
        lines += ["", "notes and savings:", *details]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from grpo_patches.demo import DEFAULT_STEPS  # the demo's defaults only (this imports nothing)

    parser = argparse.ArgumentParser(prog="grpo-patches", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"grpo-patches {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    text = "what is installed, supported and patched, in this process"
    st = sub.add_parser("status", help=text, description=text)
    st.add_argument("--json", action="store_true", help="print the report as JSON")
    text = "train the embedded tiny model with TRL twice, patches off and on, and compare"
    demo = sub.add_parser("demo", help=text, description=text)
    demo.add_argument("--steps", type=int, default=DEFAULT_STEPS,
                      help=f"optimizer steps per run (default: {DEFAULT_STEPS})")
    demo.add_argument("--no-progress", action="store_true",
                      help="print only the result table: no progress bars (default: a bar per run)")
    for name, text in (("env", "print the variables that patch every process started from this shell "
                                "(Ray workers included): the start-up directory on PYTHONPATH"),
                       ("run", "run a command with those variables (like opentelemetry-instrument)")):
        cmd = sub.add_parser(name, help=text, description=text)
        cmd.add_argument("--frameworks", default=os.environ.get("GRPO_PATCHES") or "all",
                         help="GRPO_PATCHES: a comma list of frameworks, or all (default: $GRPO_PATCHES or all)")
        cmd.add_argument("--options", default=os.environ.get("GRPO_PATCHES_OPTIONS", ""),
                         help="GRPO_PATCHES_OPTIONS, e.g. tiled_loss=1,tile_size=512 (default: $GRPO_PATCHES_OPTIONS)")
        cmd.add_argument("--dir", default=None,
                         help="where to build the start-up directory (default: ~/.cache/grpo_patches/startup-<hash>; "
                              "on several nodes, a shared filesystem)")
        if name == "run":
            cmd.add_argument("argv", metavar="command", nargs=argparse.REMAINDER, help="-- the command to run")
        else:
            cmd.add_argument("--json", action="store_true", help="print the variables as JSON")
    args = parser.parse_args(argv)

    if args.command in ("env", "run"):
        return _startup_command(args)
    if args.command == "status":
        from grpo_patches import status

        report = status()
        print(json.dumps(report, indent=2) if args.json else format_status(report))
        return 0
    from grpo_patches.demo.compare import run_demo

    return run_demo(steps=args.steps, progress=not args.no_progress)


def _startup_command(args: argparse.Namespace) -> int:
    from grpo_patches import startup_path
    from grpo_patches.errors import GrpoPatchesError
    from grpo_patches.options import parse_env_options

    try:
        parse_env_options(args.options)  # a malformed value is an error here, not a warning in every worker
    except GrpoPatchesError as exc:
        print(f"grpo-patches {args.command}: --options: {exc}", file=sys.stderr)
        return 2
    directory = startup_path.build(args.dir)
    env = startup_path.environment(directory, args.frameworks, args.options)
    if args.command == "env":
        if args.json:
            print(json.dumps(env, indent=2))
        else:
            print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items()))
        return 0
    command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not command:
        print("grpo-patches run: give the command after --, e.g. grpo-patches run -- python train.py", file=sys.stderr)
        return 2
    os.execvpe(command[0], command, {**os.environ, **env})
    return 127  # pragma: no cover - execvpe does not return


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
