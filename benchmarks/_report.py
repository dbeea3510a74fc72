"""Table, targets, JSON and PNG chart for the lm-head GRPO loss benchmark."""

from __future__ import annotations

import json
from pathlib import Path

GB = 1e9
TIME_VS_DENSE = 0.7  # project fwd+bwd time <= 0.7 x dense
TIME_VS_PEER = 0.8  # ... and <= 0.8 x the fastest installed peer
PEAK_VS_FLOOR = 1.1  # project peak extra memory <= 1.1 x floor


def floor_bytes(tokens: int, hidden: int, vocab: int, tile: int, elem_bytes: int = 4) -> int:
    """The two gradients plus one tile of logits: 4*(N*H + V*H) + 4*tile*V bytes (fp32)."""
    return elem_bytes * (tokens * hidden + vocab * hidden) + elem_bytes * tile * vocab


def _fmt(x, spec: str) -> str:
    width = int(spec.split(".")[0] or 0)
    return "-".rjust(width) if x is None else format(x, spec)


def enrich(rows: list[dict]) -> None:
    """Add ratios to dense and to the floor to every successful row (in place)."""
    for row in rows:
        dense = next((r for r in rows if r["impl"] == "dense" and r["config"] == row["config"]
                      and r["status"] == "ok"), None)
        ok = row["status"] == "ok"
        row["time_vs_dense"] = row["time_median_s"] / dense["time_median_s"] if ok and dense else None
        row["peak_vs_floor"] = row["peak_extra_bytes"] / row["floor_bytes"] if ok else None


def format_table(rows: list[dict]) -> str:
    head = (f"{'impl':<10} {'config':<22} {'time med s':>10} {'x dense':>8} {'peak GB':>8} {'x floor':>8} "
            f"{'grad diff':>10}  status")
    lines = [head, "-" * len(head)]
    for r in rows:
        ok = r["status"] == "ok"
        lines.append(
            f"{r['impl']:<10} {r['config']:<22} {_fmt(r.get('time_median_s') if ok else None, '10.3f')} "
            f"{_fmt(r.get('time_vs_dense'), '8.2f')} "
            f"{_fmt(r['peak_extra_bytes'] / GB if ok else None, '8.2f')} {_fmt(r.get('peak_vs_floor'), '8.2f')} "
            f"{_fmt(r.get('max_grad_diff') if ok else None, '10.1e')}  {r['status']}"
        )
    return "\n".join(lines)


def check_targets(rows: list[dict], peers: tuple[str, ...]) -> list[str]:
    """One line per config and target: the measured ratio and MET / NOT MET (or why it cannot be judged)."""
    lines = []
    for config in dict.fromkeys(r["config"] for r in rows):
        group = {r["impl"]: r for r in rows if r["config"] == config}
        proj = group.get("project")
        if not proj or proj["status"] != "ok":
            lines.append(f"{config}: project not measured ({proj['status'] if proj else 'not selected'})")
            continue
        verdict = lambda ok: "MET" if ok else "NOT MET"  # noqa: E731
        dense = group.get("dense")
        if dense and dense["status"] == "ok":
            ratio = proj["time_median_s"] / dense["time_median_s"]
            lines.append(f"{config}: time vs dense {ratio:.2f} (target <= {TIME_VS_DENSE}) "
                         f"{verdict(ratio <= TIME_VS_DENSE)}")
        else:
            lines.append(f"{config}: time vs dense: dense not measured")
        ok_peers = [group[p] for p in peers if p in group and group[p]["status"] == "ok"]
        if ok_peers:
            fastest = min(ok_peers, key=lambda r: r["time_median_s"])
            ratio = proj["time_median_s"] / fastest["time_median_s"]
            lines.append(f"{config}: time vs fastest peer ({fastest['impl']}) {ratio:.2f} "
                         f"(target <= {TIME_VS_PEER}) {verdict(ratio <= TIME_VS_PEER)}")
        else:
            lines.append(f"{config}: time vs fastest peer: no peer measured")
        ratio = proj["peak_vs_floor"]
        lines.append(f"{config}: peak vs floor {ratio:.2f} (target <= {PEAK_VS_FLOOR}) "
                     f"{verdict(ratio <= PEAK_VS_FLOOR)}")
    return lines


def write_json(path: Path, meta: dict, rows: list[dict], targets: list[str]) -> None:
    path.write_text(json.dumps({"meta": meta, "rows": rows, "targets": targets}, indent=2))


def write_chart(path: Path, rows: list[dict], title: str) -> None:
    """Two panels per run: median fwd+bwd time and peak extra memory (floor as a marker), per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys(r["config"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(impls))
    for i, impl in enumerate(impls):
        xs, ts, ms = [], [], []
        for j, config in enumerate(configs):
            r = next((r for r in rows if r["impl"] == impl and r["config"] == config and r["status"] == "ok"), None)
            if r:
                xs.append(j + i * width)
                ts.append(r["time_median_s"])
                ms.append(r["peak_extra_bytes"] / GB)
        axes[0].bar(xs, ts, width, label=impl)
        axes[1].bar(xs, ms, width, label=impl)
    for j, config in enumerate(configs):
        floor = next(r["floor_bytes"] for r in rows if r["config"] == config) / GB
        axes[1].hlines(floor, j - width / 2, j + 0.8 - width / 2, colors="k", linestyles="--",
                       label="floor" if j == 0 else None)
    for ax, ylabel in zip(axes, ("fwd+bwd time, median (s)", "peak extra memory (GB)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(configs))], configs, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
