"""Table, targets, JSON and PNG chart for the lm-head GRPO loss benchmark."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

GB = 1e9
#: project fwd+bwd time / dense's (issue 32), by (device, large vocabulary: V >= LARGE_VOCAB)
TIME_VS_DENSE = {("cpu", False): 0.6, ("cpu", True): 0.5, ("cuda", False): 0.9, ("cuda", True): 0.45}
LARGE_VOCAB = 100_000
TIME_VS_PEER = 0.8  # CPU: project time <= 0.8 x the fastest installed peer (CUDA: faster than TRL's head)
PEAK_VS_FLOOR = 1.1  # CPU: project peak extra memory <= 1.1 x floor
PEAK_VS_DENSE_CUDA = 0.2  # CUDA, large vocabulary: peak <= 0.2 x dense's


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
        if ok and row.get("round_ratios"):  # rounds: the median of the same-round ratios
            row["time_vs_dense"] = statistics.median(row["round_ratios"])
        else:
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
    verdict = lambda ok: "MET" if ok else "NOT MET"  # noqa: E731
    for config in dict.fromkeys(r["config"] for r in rows):
        group = {r["impl"]: r for r in rows if r["config"] == config}
        proj = group.get("project")
        if not proj or proj["status"] != "ok":
            lines.append(f"{config}: project not measured ({proj['status'] if proj else 'not selected'})")
            continue
        cuda, large = proj["device"] == "cuda", proj["vocab"] >= LARGE_VOCAB
        dense = group.get("dense")
        if dense and dense["status"] == "ok":
            ratio, target = proj["time_vs_dense"], TIME_VS_DENSE[("cuda" if cuda else "cpu", large)]
            lines.append(f"{config}: time vs dense {ratio:.2f} (target <= {target}) {verdict(ratio <= target)}")
            if cuda and large:
                peak = proj["peak_extra_bytes"] / dense["peak_extra_bytes"]
                lines.append(f"{config}: peak vs dense {peak:.2f} (target <= {PEAK_VS_DENSE_CUDA}) "
                             f"{verdict(peak <= PEAK_VS_DENSE_CUDA)}")
        else:
            lines.append(f"{config}: time vs dense: dense not measured")
        ok_peers = [group[p] for p in peers if p in group and group[p]["status"] == "ok"]
        if cuda:
            trl = group.get("trl")
            if trl and trl["status"] == "ok":
                ratio = proj["time_median_s"] / trl["time_median_s"]
                lines.append(f"{config}: time vs TRL's head {ratio:.2f} (target < 1) {verdict(ratio < 1)}")
            else:
                lines.append(f"{config}: time vs TRL's head: trl not measured")
        elif ok_peers:
            fastest = min(ok_peers, key=lambda r: r["time_median_s"])
            ratio = proj["time_median_s"] / fastest["time_median_s"]
            lines.append(f"{config}: time vs fastest peer ({fastest['impl']}) {ratio:.2f} "
                         f"(target <= {TIME_VS_PEER}) {verdict(ratio <= TIME_VS_PEER)}")
        else:
            lines.append(f"{config}: time vs fastest peer: no peer measured")
        if not cuda:
            ratio = proj["peak_vs_floor"]
            lines.append(f"{config}: peak vs floor {ratio:.2f} (target <= {PEAK_VS_FLOOR}) "
                         f"{verdict(ratio <= PEAK_VS_FLOOR)}")
    return lines


def write_json(path: Path, meta: dict, rows: list[dict], targets: list[str]) -> None:
    path.write_text(json.dumps({"meta": meta, "rows": rows, "targets": targets}, indent=2))


def write_chart(path: Path, rows: list[dict], title: str) -> None:
    """Two panels per run: median fwd+bwd time and peak extra memory (floor as a marker), per config."""
    try:
        import matplotlib
    except ImportError:  # e.g. a lent GPU machine: the table and the JSON are the results
        print(f"matplotlib not installed: no chart ({path.name})")
        return

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
