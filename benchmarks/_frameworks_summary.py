"""``frameworks.py``'s summary: one report row per framework from its rounds of (off, on) runs."""

from __future__ import annotations

import statistics
from typing import Any


def old_logprob_rows(run: dict[str, Any]) -> int | None:
    """Rows the run's old-logprob passes computed (``None``: the runner does not count them).

    A runner gives ``old_logprob_rows`` (rows handed to the framework's pass) and, where the
    framework's metrics have it, ``old_logprob_rows_skipped`` (``grpo_patches/old_logprob_rows_skipped``:
    rows of those calls whose pass the patches skipped; absent = 0). TRL's runner counts beneath
    the patches, so its rows are already net of the skipped ones (``old_logprob_rows_net``).
    """
    if run.get("old_logprob_rows") is None:
        return None
    if run.get("old_logprob_rows_net", False):
        return int(run["old_logprob_rows"])
    return int(run["old_logprob_rows"]) - int(run.get("old_logprob_rows_skipped", 0))


def summarise(name: str, spec: dict, runs: list[tuple[dict, dict, float | None]],
              verified: list[dict] | None = None) -> dict[str, Any]:
    """One row per framework from its (off, on, weight diff) rounds (and ``--verify``'s runs, one a round)."""
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
    extra: dict[str, Any] = {}
    pairs = [(on, v) for (off, on, _), v in zip(runs, verified or []) if "error" not in on and "error" not in v
             and "not_run" not in v]
    if pairs:  # a verify step against a normal patched one of the same round
        extra = {"verify_ratio": statistics.median(per_step(v, "trainer_side") / per_step(on, "trainer_side")
                                                   for on, v in pairs),
                 "verify_ratio_cpu": (statistics.median(per_step(v, "cpu_trainer_side") / per_step(on, "cpu_trainer_side")
                                                        for on, v in pairs) if "cpu_trainer_side" in on_last["steps"][0]
                                      else None),
                 "verify_figures": {k: max(v.get("verify_figures", {}).get(k, 0.0) for _, v in pairs)
                                    for k in sorted({k for _, v in pairs for k in v.get("verify_figures", {})})}}
    elif verified:
        extra = {"verify_ratio": None, "verify_error": next((v.get("error") for v in verified if "error" in v), None)}
    return {**extra,
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
        "mini_batches": spec.get("mini_batches", 1),
        "old_logprob_rows": [old_logprob_rows(off_last), old_logprob_rows(on_last)],
        "policy_tokens": [off_last.get("policy_tokens"), on_last.get("policy_tokens")],
        "policy_calls": [off_last.get("policy_calls"), on_last.get("policy_calls")],
        "padding_tokens_skipped": on_last.get("padding_tokens_skipped"),
        "stages_s": stages(spec, ok),
    }


def stages(spec: dict, ok: list[tuple[dict, dict, float | None]]) -> dict[str, list[float]] | None:
    """Per stage of the trainer side (a runner's ``steps[i]["stages"]``, NeMo-RL's own timers): the
    median over rounds of each run's per-step median, ``[off, on]`` (``None``: no runner gave stages)."""
    names = sorted({k for off, on, _ in ok for run in (off, on) for step in run["steps"] for k in step.get("stages", {})})
    if not names:
        return None

    def per_step(run: dict, name: str) -> float:
        return statistics.median(s.get("stages", {}).get(name, 0.0) for s in run["steps"][spec["warmup"]:] or run["steps"])

    return {n: [statistics.median(per_step(off, n) for off, _, _ in ok), statistics.median(per_step(on, n) for _, on, _ in ok)]
            for n in names}
