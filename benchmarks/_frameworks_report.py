"""Table (Markdown), JSON and PNG of ``benchmarks/frameworks.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

NAMES = {"trl": "TRL", "verl": "verl", "verl_v1": "verl", "nemo_rl": "NeMo-RL", "open_instruct": "open-instruct"}


def _pair(values: list[Any], fmt: str = "{}") -> str:
    return " → ".join(fmt.format(v) for v in values)


def _counts(values: list[Any] | None) -> str:
    """``off → on (ratio)`` of two counts; ``-`` where the runner does not count them."""
    if not values or any(v is None for v in values):
        return "-"
    off, on = values
    return f"{off} → {on}" + (f" ({on / off:.2f}×)" if off else "")


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}×"


def table(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    head = ("| framework | trainer code | trainer side s/step off → on | ratio | CPU-s ratio | generation s/step | "
            "old-logprob passes | reference passes | rows dropped | peak RSS MB | max abs Δ final weights | "
            "old-logprob rows computed | policy tokens through the forward | forward/backward calls |")
    lines = [f"Measured {meta['date']}, {meta['rounds']} round(s), {meta['cpu_count']} CPU cores: {meta['workload']}.",
             f"Command: `{meta['command']}`."]
    batches = meta.get("spec", {}).get("mini_batches", 1)
    if batches > 1:
        lines.append(f"{batches} mini-batches: a \"step\" below is one rollout batch ({batches} optimizer steps).")
    if meta.get("interpreters"):
        lines.append("Interpreters: " + "; ".join(meta["interpreters"].values()) + ".")
    lines += ["", head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        name = NAMES.get(r["framework"], r["framework"])
        if r["status"] != "ok":
            lines.append(f"| {name} | {r['status']} |" + " |" * (head.count("|") - 3))
            continue
        lines.append(
            f"| {name} {r['version']} | {r['line']} | {r['trainer_side_off_s']:.3f} → {r['trainer_side_on_s']:.3f} "
            f"| **{r['ratio']:.2f}×** | {_ratio(r.get('ratio_cpu'))} | {r['generation_s']:.3f} | {_pair(r['old_logprob_passes'])} "
            f"| {_pair(r['reference_passes'])} | {r['rows_dropped']} / {r['rows_total']} "
            f"| {_pair(r['peak_rss_mb'], '{:.0f}')} | {r['max_weight_diff']:.1e} "
            f"| {_counts(r.get('old_logprob_rows'))} | {_counts(r.get('policy_tokens'))} "
            f"| {_counts(r.get('policy_calls'))} |")
    for r in rows:  # the framework's own per-stage timers where a runner gives them (NeMo-RL)
        if r["status"] == "ok" and r.get("stages_s"):
            lines.append("")
            lines.append(f"{NAMES.get(r['framework'], r['framework'])} {r['version']} per stage, s/step off → on: "
                         + ", ".join(f"`{n}` {_pair(v, '{:.3f}')}" for n, v in r["stages_s"].items()) + ".")
    return "\n".join(lines)


def chart(path: Path, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        return
    names = [f"{NAMES.get(r['framework'], r['framework'])}\n{r['version']}" for r in ok]
    panels = [
        ("trainer side s / step", lambda r: [r["trainer_side_off_s"], r["trainer_side_on_s"]]),
        ("old-logprob passes", lambda r: r["old_logprob_passes"]),
        ("reference passes", lambda r: r["reference_passes"]),
        ("rows in the update", lambda r: [r["rows_total"], r["rows_total"] - r["rows_dropped"]]),
        ("peak RSS (MB)", lambda r: r["peak_rss_mb"]),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6.5))
    for ax, (title, values) in zip(axes.flat, panels):
        x = range(len(ok))
        off, on = zip(*(values(r) for r in ok))
        ax.bar([i - 0.2 for i in x], off, 0.4, label="unpatched", color="#999999")
        ax.bar([i + 0.2 for i in x], on, 0.4, label="grpo_patches", color="#1f77b4")
        if title.startswith("trainer"):
            for i, r in enumerate(ok):
                ax.text(i + 0.2, r["trainer_side_on_s"], f"{r['ratio']:.2f}×", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x), names, fontsize=8)
        ax.set_title(title, fontsize=9)
    axes.flat[0].legend(fontsize=8)
    ax = axes.flat[5]
    diffs = [max(r["max_weight_diff"], 1e-12) for r in ok]
    ax.bar(range(len(ok)), diffs, 0.4, color="#1f77b4")
    for i, r in enumerate(ok):
        ax.text(i, max(r["max_weight_diff"], 1e-12), "0 (bitwise)" if r["max_weight_diff"] == 0 else
                f"{r['max_weight_diff']:.1e}", ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(1e-12, 1)
    ax.set_xticks(range(len(ok)), names, fontsize=8)
    ax.set_title("max |Δ final weights| (0 drawn at 1e-12)", fontsize=9)
    fig.suptitle(meta["workload"], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def verify_lines(rows: list[dict[str, Any]]) -> str:
    """``--verify``: a verify step's cost against a normal patched step, per framework that ran one."""
    lines = []
    for r in rows:
        if "verify_ratio" not in r:
            continue
        if r["verify_ratio"] is None:
            lines.append(f"- {NAMES.get(r['framework'], r['framework'])}: verify run failed: {r.get('verify_error')}")
            continue
        figures = ", ".join(f"{k.rsplit('/', 1)[-1]} <= {v:.1e}" for k, v in r["verify_figures"].items())
        lines.append(f"- {NAMES.get(r['framework'], r['framework'])}: a verify step (verify_every=1) takes "
                     f"**{r['verify_ratio']:.2f}×** the trainer-side time of a normal patched step (CPU time: "
                     f"{_ratio(r.get('verify_ratio_cpu'))}; median over rounds); figures: {figures or 'none'}")
    return "\n\nVerify mode (`--verify`):\n\n" + "\n".join(lines) if lines else ""


def write(out: Path, meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    out.mkdir(parents=True, exist_ok=True)
    text = table(meta, rows) + verify_lines(rows)
    (out / "frameworks.md").write_text(text + "\n")
    (out / "frameworks.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    chart(out / "frameworks.png", meta, rows)
    return text + f"\n\nwrote {out / 'frameworks.md'}, frameworks.json, frameworks.png"
