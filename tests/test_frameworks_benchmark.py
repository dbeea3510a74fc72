"""benchmarks/frameworks.py: the summary and the table it derives from runs (no framework runs here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _frameworks_report as report  # noqa: E402
import frameworks  # noqa: E402
import workload  # noqa: E402

SPEC = {**workload.SPEC, "warmup": 1}


def _run(times, old=3, ref=3, dropped=0, rss=600.0):
    return {"version": "9.9", "line": "Actor", "steps": [{"trainer_side": t, "generation": 1.0} for t in times],
            "old_logprob_passes": old, "reference_passes": ref, "rows_dropped": dropped, "rows_total": 192,
            "peak_rss_mb": rss}


def test_ratio_is_the_median_of_same_round_ratios_after_warmup():
    rounds = [(_run([9.0, 2.0, 2.0]), _run([9.0, 1.0, 1.0], 0, 0, 144), 0.0),
              (_run([9.0, 4.0, 4.0]), _run([9.0, 1.0, 1.0], 0, 0, 144), 1e-9),
              (_run([9.0, 2.0, 2.0]), _run([9.0, 0.5, 0.5], 0, 0, 144), 0.0)]
    row = frameworks.summarise("verl", SPEC, rounds)
    assert row["ratio"] == pytest.approx(0.25)  # ratios 0.5, 0.25, 0.25: the warm-up step (9 s) is left out
    assert row["trainer_side_off_s"] == 2.0 and row["trainer_side_on_s"] == 1.0
    assert row["old_logprob_passes"] == [3, 0] and row["rows_dropped"] == 144 and row["max_weight_diff"] == 1e-9


def test_failed_and_skipped_runs_become_rows_with_the_reason():
    failed = frameworks.summarise("trl", SPEC, [({"error": "exit 1: boom"}, _run([1.0, 1.0]), None)])
    assert failed["status"] == "failed: exit 1: boom"
    skipped = frameworks.summarise("verl", SPEC, [({"not_run": "engine line"}, {"not_run": "engine line"}, None)])
    assert skipped["status"] == "not run: engine line"
    text = report.table({"date": "d", "rounds": 1, "cpu_count": 2, "workload": "w", "command": "c"},
                        [frameworks.summarise("verl", SPEC, [(_run([1, 2]), _run([1, 1]), 0.0)]), failed, skipped])
    lines = text.splitlines()
    assert "| verl 9.9 | Actor | 2.000 → 1.000 | **0.50×** |" in text
    assert len({line.count("|") for line in lines if line.startswith("|")}) == 1  # every row has every column


def test_a_framework_without_an_interpreter_is_not_run(monkeypatch, tmp_path):
    monkeypatch.delenv("GRPO_BENCH_PYTHON_NEMO_RL", raising=False)
    monkeypatch.setattr(frameworks, "ROOT", tmp_path)  # no compat venvs
    python, why = frameworks.find_python("nemo_rl", {"nemo_rl": "/nonexistent/python"})
    assert python is None and "/nonexistent/python" in why


def test_the_reward_makes_the_saturated_groups_constant():
    prompts = workload.prompt_texts(SPEC)
    for i, prompt in enumerate(prompts):
        values = {workload.reward(SPEC, prompt, completion) for completion in ("ba be", "ca", "zus 7 8")}
        assert (len(values) == 1) == (i < SPEC["saturated"])
    assert workload.zero_share(SPEC) == 0.75


def test_the_verl_main_ppo_runner_scores_as_the_workload():
    import fw_verl_v1

    prompts, truths = fw_verl_v1._dataset({**SPEC, "steps": 2})
    assert len(prompts) == 2 * SPEC["prompts"]  # the workload's prompts once per step
    for prompt, truth in zip(prompts, truths):
        for completion in ("ba be", "ca", "zus 7 8"):
            assert fw_verl_v1.compute_score("grpo_e2e", completion, truth) == workload.reward(SPEC, prompt, completion)
    assert frameworks.VENVS["verl_v1"] == "verl" and frameworks.FRAMEWORKS["verl_v1"] == "verl"
