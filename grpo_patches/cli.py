"""Command line: ``grpo-patches status`` (a table, or ``--json``) and ``grpo-patches demo``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence


def format_status(report: dict[str, dict[str, Any]]) -> str:
    """Render :func:`grpo_patches.status` as a plain-text table plus notes and savings."""
    header = ("framework", "installed", "supported range", "supported", "patched", "options")
    rows = [header]
    details: list[str] = []
    for name, entry in report.items():
        supported = "yes" if entry["supported"] else f"no ({entry['reason']})"
        patched = {(True, False): "yes", (False, True): "pending import", (True, True): "partly (rest pending import)"}.get(
            (entry["patched"], entry["pending_import"]), "no")
        options = entry["options"]
        shown = ", ".join(f"{k}={v}" for k, v in options.items()) if options else "-"
        rows.append((name, entry["installed"] or "-", entry["supported_range"], supported, patched, shown))
        if entry.get("error"):
            details.append(f"  {name}: error: {entry['error']}")
        for record in entry.get("patches", []):
            if record["state"] != "applied":
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
    parser = argparse.ArgumentParser(prog="grpo-patches", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    st = sub.add_parser("status", help="what is installed, supported and patched")
    st.add_argument("--json", action="store_true", help="print the report as JSON")
    demo = sub.add_parser("demo", help="train the embedded tiny model with TRL, patches off and on")
    demo.add_argument("--steps", type=int, default=None, help="optimizer steps per run")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    if args.command == "status":
        from grpo_patches import status

        report = status()
        print(json.dumps(report, indent=2) if args.json else format_status(report))
        return 0
    from grpo_patches.demo import run_demo

    return run_demo(steps=args.steps, progress=not args.no_progress)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
