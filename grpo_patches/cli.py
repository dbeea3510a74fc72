"""Command line: ``grpo-patches status`` (a table, or ``--json``), ``grpo-patches demo``, and the
start-up path for Ray workers: ``grpo-patches run -- python train.py ...`` / ``grpo-patches env``."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import textwrap
from typing import Any, Sequence

from grpo_patches import __version__

#: ``grpo-patches --help``'s description (plain text: the module docstring is reStructuredText).
DESCRIPTION = ("Exact optimizations for GRPO training in TRL, verl and NeMo-RL. Patch a framework in Python with "
               "grpo_patches.enable(\"trl\"), or in every process with GRPO_PATCHES=trl; this command reports what is "
               "patched, runs the demo, and starts processes (Ray workers included) with the patches.")


#: The status table fits this many columns; longer notes wrap under their key.
WIDTH = 100


def _wrapped(text: str, indent: str = "  ", hang: str = "    ") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + hang,
                         break_long_words=False, break_on_hyphens=False) or [indent]


def _patched(entry: dict[str, Any]) -> str:
    if not entry["supported"]:
        return f"no: {entry['reason']}"
    return {(True, False): "yes", (False, True): "on import (below)",
            (True, True): "yes, more on import (below)"}.get((entry["patched"], entry["pending_import"]), "no")


def _options(options: dict[str, Any]) -> str:
    """The options that differ from the defaults (all of them read from ``status()``)."""
    from grpo_patches.options import Options

    defaults = Options().as_dict()
    changed = [f"{k}={v}" for k, v in options.items() if defaults.get(k, object()) != v]
    return ", ".join(changed) + ("; the others at their defaults" if changed else "all at their defaults")


def _records(entry: dict[str, Any]) -> list[str]:
    """One line per patched attribute that has records not applied: which option keeps each off."""
    off: dict[str, list[str]] = {}
    for record in entry.get("patches", []):
        if record["state"] not in ("applied", "pending import"):  # those waiting: the summary says so
            state = record["state"].removeprefix("off (").removesuffix(")") if record["state"].startswith("off (") \
                else record["state"]
            off.setdefault(record["target"].partition(":")[2] or record["target"], []).append(state)
    return [f"{target}: off ({'; '.join(dict.fromkeys(states))})" for target, states in off.items()]


def format_status(report: dict[str, dict[str, Any]]) -> str:
    """Render :func:`grpo_patches.status` as plain text in :data:`WIDTH` columns: a table of the
    frameworks, then per enabled framework its options, patches, notes and savings."""
    header = ("framework", "installed", "supported versions", "patched in this process")
    rows = [header] + [(name, e["installed"] or "-", e.get("supported_versions") or e["supported_range"], _patched(e))
                       for name, e in report.items()]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header) - 1)]
    lines = ["  ".join([*(str(c).ljust(w) for c, w in zip(r, widths)), str(r[-1])]).rstrip() for r in rows]
    lines.insert(1, "  ".join([*("-" * w for w in widths), "-" * len(header[-1])]))
    for name, entry in report.items():
        details: list[str] = []
        if entry.get("version_origin"):
            details.append(f"version: {entry['version_origin']}")
        if entry.get("error"):
            details.append(f"error: {entry['error']}")
        if entry.get("summary"):
            details.append(entry["summary"])
        if entry.get("options") is not None:
            details.append(f"options: {_options(entry['options'])}")
        details += _records(entry)
        details += [f"{key}: {text}" for key, text in entry["notes"].items()]
        details += [f"[{klass}] {key}: {text}" for klass, notes in entry.get("by_class", {}).items()
                    for key, text in notes.items()]
        details += [f"saved {key} = {value:g}" for key, value in sorted(entry["savings"].items())]
        if details:
            lines += ["", f"{name}:"] + [line for detail in details for line in _wrapped(detail)]
    if not any(entry["patched"] or entry["pending_import"] for entry in report.values()):
        lines += ["", *_wrapped("Nothing is patched in this process: grpo-patches status reports only itself. To see "
                                "a patched one, run it with the variable set (GRPO_PATCHES=trl grpo-patches status), or "
                                "print grpo_patches.status() in the training process (Ray workers report their own).",
                                indent="", hang="")]
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
