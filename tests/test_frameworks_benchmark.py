"""benchmarks/frameworks.py: the summary and table it derives from runs, and which interpreter runs each
framework by default (fake venvs; no framework runs here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_patches import registry

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _frameworks_report as report  # noqa: E402
import _interpreters as interpreters  # noqa: E402
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


def _fake_venv(root: Path, session: str, versions: dict[str, str | None], grpo_patches: bool = True) -> Path:
    """A compat venv whose "python" answers the version probe (and nothing else)."""
    python = root / "compat" / ".nox" / session / "bin" / "python"
    python.parent.mkdir(parents=True)
    answer = json.dumps({"grpo_patches": grpo_patches, "versions": {"trl": None, "verl": None, **versions}})
    python.write_text(f"#!/bin/sh\necho '{answer}'\n")
    python.chmod(0o755)
    return python


@pytest.fixture
def fake_checkout(tmp_path, monkeypatch):
    """The issue's case: after the compat CI cells, TRL 0.20.0 and verl 0.7.1 / 0.9.1 venvs exist."""
    for variable in ("GRPO_BENCH_PYTHON_TRL", "GRPO_BENCH_PYTHON_VERL", "GRPO_BENCH_PYTHON_NEMO_RL", "NEMO_RL_TAG"):
        monkeypatch.delenv(variable, raising=False)
    _fake_venv(tmp_path, "cpu-trl-0-20-0", {"trl": "0.20.0"})
    _fake_venv(tmp_path, "cpu-verl-0-7-1", {"verl": "0.7.1"})
    _fake_venv(tmp_path, "cpu-verl-0-9-1", {"verl": "0.9.1"})
    _fake_venv(tmp_path, "cpu-verl-0-6-1", {"verl": "0.6.1"}, grpo_patches=False)
    return tmp_path


def _choose(name, root, given=None, tags=(), tag=None):
    pool = interpreters.candidates(name, given or {}, list(tags), tag, root)
    return pool, interpreters.choose(name, pool, registry.get(name).supported)


def test_by_default_the_newest_supported_version_of_each_framework_runs(fake_checkout):
    trl = pytest.importorskip("trl")
    pool, (chosen, origin) = _choose("trl", fake_checkout)
    assert [c.version for c in pool] == [trl.__version__, "0.20.0", None, None, None]  # this one, then the venvs
    assert chosen.python == sys.executable and origin.startswith("this interpreter")  # 1.16, not the venv's 0.20
    pool, (chosen, origin) = _choose("verl", fake_checkout)
    assert chosen.version == "0.7.1"  # 0.9.1 is the engine line: no runner; 0.6.1's venv lacks grpo_patches
    assert origin == "compat venv compat/.nox/cpu-verl-0-7-1"
    assert "no grpo_patches" in next(c.origin for c in pool if "0-6-1" in c.python)


def test_the_choice_keeps_to_the_adapter_and_the_runner_and_prefers_the_earlier_on_a_tie():
    pool = [interpreters.Interpreter("a", "a", "0.7.1"), interpreters.Interpreter("b", "b", "0.9.1"),
            interpreters.Interpreter("c", "c", "0.7.1"), interpreters.Interpreter("d", "d", "0.5.0")]
    assert interpreters.choose("verl", pool, ">=0.6.1,<0.10")[0].python == "a"
    assert interpreters.choose("verl", pool[2:], ">=0.8")[0] is None
    chosen, why = interpreters.choose("verl", pool[3:], ">=0.6.1,<0.10")
    assert chosen is None and "verl 0.5.0 in d" in why


def test_a_given_interpreter_is_the_only_candidate(fake_checkout, monkeypatch):
    venv = str(fake_checkout / "compat" / ".nox" / "cpu-verl-0-9-1" / "bin" / "python")
    pool, (chosen, why) = _choose("verl", fake_checkout, {"verl": venv})
    assert [c.origin for c in pool] == ["--python"] and chosen is None and "verl 0.9.1 in --python" in why
    monkeypatch.setenv("GRPO_BENCH_PYTHON_VERL", str(fake_checkout / "nonexistent"))
    pool, (chosen, why) = _choose("verl", fake_checkout)
    assert chosen is None and "no verl in $GRPO_BENCH_PYTHON_VERL: does not run" in why


def test_nemo_rl_runs_the_newest_tag_that_has_a_venv(fake_checkout, monkeypatch):
    tags = [("main", "0.8.0.dev0"), ("v0.7.0", "0.7.0"), ("v0.6.0", "0.6.0"), ("v0.5.0", "0.5.0rc0")]
    for tag in ("main", "v0.6.0", "v0.5.0"):
        _fake_venv(fake_checkout, f"cpu-nemo_rl-{interpreters.nox_dir(tag)}", {})
    pool, (chosen, origin) = _choose("nemo_rl", fake_checkout, tags=tags)
    assert [c.tag for c in pool] == ["main", "v0.6.0", "v0.5.0"]  # v0.7.0 has no venv
    assert chosen.tag == "main" and origin == "compat venv compat/.nox/cpu-nemo_rl-main"  # the newest tag with a venv
    _, (chosen, _) = _choose("nemo_rl", fake_checkout, {"nemo_rl": "/x/python"}, tags=tags, tag="v0.7.0")
    assert (chosen.tag, chosen.python, chosen.origin) == ("v0.7.0", "/x/python", "--python, tag v0.7.0")
    monkeypatch.delenv("NEMO_RL_SRC", raising=False)
    python, why = frameworks.find_python("nemo_rl", {})
    assert python is None and "set NEMO_RL_SRC" in why


def test_open_instruct_runs_from_its_clone_in_its_cells_venv(fake_checkout, monkeypatch):
    """open-instruct, like NeMo-RL, is exported per ref from a clone: its candidates are its cells' venvs."""
    tags = frameworks.matrix_tags("open_instruct")
    assert [tag for tag, _ in tags] == ["main", "v0.3.0"]  # newest first (main reads as 0.3.1.dev0)
    _fake_venv(fake_checkout, "cpu-open_instruct-v0-3-0", {})
    pool, (chosen, origin) = _choose("open_instruct", fake_checkout, tags=tags)
    assert chosen.tag == "v0.3.0" and origin == "compat venv compat/.nox/cpu-open_instruct-v0-3-0"
    monkeypatch.delenv("OPEN_INSTRUCT_SRC", raising=False)
    python, why = frameworks.find_python("open_instruct", {})
    assert python is None and "no open-instruct checkout: set OPEN_INSTRUCT_SRC" in why


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        frameworks.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ("(default: 5, the README's run)", "(default: 1800)", "(default: benchmarks/results)",
                    f"(default: {workload.SPEC['steps']})", "(default: $NEMO_RL_TAG, else the newest tag",
                    "(default: all of them: trl, verl (legacy line), verl_v1 (main_ppo), nemo_rl, open_instruct;",
                    "(default: $OPEN_INSTRUCT_TAG, else", "(default: $GRPO_BENCH_PYTHON_<NAME>, else the newest supported"):
        assert default in text, default
    assert "3 rounds" not in frameworks.__doc__


def test_the_written_command_names_no_path_outside_the_checkout(monkeypatch):
    monkeypatch.setenv("NEMO_RL_SRC", "/somewhere/RL")
    monkeypatch.delenv("AUTOMODEL_SRC", raising=False)
    monkeypatch.chdir(frameworks.ROOT)
    line = frameworks.command_line(["--rounds", "5", "--python", "verl=compat/.nox/cpu-verl-0-7-1/bin/python",
                                    "nemo_rl=/elsewhere/nemo/bin/python"])
    assert line == ("NEMO_RL_SRC=<clone> bash scripts/run frameworks --rounds 5 --python "
                    "verl=compat/.nox/cpu-verl-0-7-1/bin/python nemo_rl=<outside the checkout>")


NO_PROJECT = """
import sys
from pathlib import Path
sys.path.insert(0, {benchmarks!r})
import frameworks
frameworks.OWN_NEEDS += ("no_such_module_here",)
frameworks.ROOT = Path({root!r})
frameworks.ensure_project_interpreter()
"""


@pytest.mark.parametrize("with_venv", [False, True])
def test_a_python_without_the_project_packages_uses_the_venv_or_says_how_to_make_it(tmp_path, with_venv):
    if with_venv:  # a .venv whose python shows how it was called
        python = tmp_path / ".venv" / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text('#!/bin/sh\necho "re-run: $@ ($GRPO_BENCH_REEXEC)"\n')
        python.chmod(0o755)
    code = NO_PROJECT.format(benchmarks=str(frameworks.HERE), root=str(tmp_path))
    env = {k: v for k, v in os.environ.items() if k != "GRPO_BENCH_REEXEC"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    if with_venv:
        assert out.returncode == 0 and out.stdout.strip() == f"re-run: {frameworks.HERE / 'frameworks.py'} (1)"
    else:
        assert out.returncode == 1 and "run it as `bash scripts/run frameworks [args]`" in out.stderr


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
    assert frameworks.ADAPTERS["verl_v1"] == "verl" and frameworks.FRAMEWORKS["verl_v1"] == "verl"


def test_the_main_ppo_runner_takes_the_newest_engine_line_verl_and_the_legacy_runner_the_newest_legacy():
    pool = [interpreters.Interpreter("a", "a", "0.7.1"), interpreters.Interpreter("b", "b", "0.9.1"),
            interpreters.Interpreter("c", "c", "0.8.0")]
    assert interpreters.choose("verl_v1", pool, registry.get("verl").supported)[0].python == "b"
    assert interpreters.choose("verl", pool, registry.get("verl").supported)[0].python == "a"
    assert interpreters.choose("verl_v1", pool[:1], registry.get("verl").supported)[0] is None


def test_old_logprob_rows_and_policy_tokens_become_off_on_columns():
    off = {**_run([1.0, 2.0]), "old_logprob_rows": 256, "policy_tokens": 9000, "policy_calls": 16}
    on = {**_run([1.0, 1.0]), "old_logprob_rows": 256, "old_logprob_rows_skipped": 208, "policy_tokens": 2000,
          "policy_calls": 4}
    trl_on = {**on, "old_logprob_rows": 64, "old_logprob_rows_net": True}  # counted beneath the patches: net
    row = frameworks.summarise("verl", {**SPEC, "mini_batches": 4}, [(off, on, 0.0)])
    assert row["old_logprob_rows"] == [256, 48] and row["policy_tokens"] == [9000, 2000] and row["mini_batches"] == 4
    assert frameworks.summarise("trl", SPEC, [(off, trl_on, 0.0)])["old_logprob_rows"] == [256, 64]
    absent = frameworks.summarise("nemo_rl", SPEC, [(_run([1.0, 2.0]), _run([1.0, 1.0]), 0.0)])
    meta = {"date": "d", "rounds": 1, "cpu_count": 2, "workload": "w", "command": "c", "spec": {"mini_batches": 4}}
    text = report.table(meta, [row, absent])
    assert "| 256 → 48 (0.19×) | 9000 → 2000 (0.22×) | 16 → 4 (0.25×) |" in text and "| - | - | - |" in text
    assert "one rollout batch (4 optimizer steps)" in text
    assert len({line.count("|") for line in text.splitlines() if line.startswith("|")}) == 1


def test_mini_batches_split_one_rollout_into_optimizer_steps():
    import fw_trl

    spec = {**SPEC, "mini_batches": 4}  # 64 rows, micro-batches of 16: one a step
    assert fw_trl.schedule(spec) == {"max_steps": 4 * SPEC["steps"], "gradient_accumulation_steps": 1,
                                     "steps_per_generation": 4}
    assert fw_trl.schedule(SPEC)["gradient_accumulation_steps"] == fw_trl.schedule(SPEC)["steps_per_generation"] == 4
    with pytest.raises(ValueError, match="--mini-batches 8"):
        fw_trl.schedule({**SPEC, "mini_batches": 8})
    steps = [{"trainer_side": float(i), "generation": 1.0} for i in range(8)]
    assert [s["trainer_side"] for s in fw_trl.per_rollout(steps, 4)] == [6.0, 22.0]
    with pytest.raises(SystemExit):
        frameworks.main(["--mini-batches", "3", "--frameworks", "trl"])  # 8 prompts do not split in 3


def test_variable_lengths_vary_the_prompts_and_the_eos():
    spec = {**SPEC, "variable_lengths": True}
    words = {len(p.split()) for p in workload.prompt_texts(spec)}
    assert len(words) > 3 and min(words) >= 2 and max(words) <= 8
    assert workload.eos_boost(spec) == workload.EOS_BOOST and workload.eos_boost(SPEC) == 1.0
    assert [len(p.split()) for p in workload.prompt_texts(SPEC)] == [4] * SPEC["prompts"]


def test_policy_token_counters_count_only_forwards_with_gradients():
    """verl's legacy runner and NeMo-RL v0.6.0's count rows x columns of the forwards with gradients
    (the update's), not the log-prob passes' (no gradients), whether ids come by keyword or position."""
    import torch

    import fw_nemo_rl
    import fw_verl

    class Model(torch.nn.Module):
        def forward(self, input_ids=None, **_):
            return input_ids

    ids = torch.zeros(3, 7, dtype=torch.long)
    model = Model()
    counter = fw_verl._TokenCounter(model)
    worker = type("Worker", (), {"model": Model()})()
    group = fw_nemo_rl._Group(worker)
    for m in (model, worker.model):
        m(input_ids=ids)
        m(ids)
        with torch.no_grad():
            m(input_ids=ids)
    assert counter.tokens == group.policy_tokens == 42
    assert group.forwards[0] == 3  # every forward still counts as one (the skipped-pass check)


def test_stages_are_medians_per_stage_after_warmup():
    """NeMo-RL's per-stage timers (``steps[i]["stages"]``) summarised per stage, off and on; other runners: None."""
    def staged(values):
        return {**_run([sum(v) for v in values]),
                "steps": [{"trainer_side": sum(v), "generation": 1.0, "stages": {"prep": v[0], "train": v[1]}}
                          for v in values]}

    rounds = [(staged([(9.0, 9.0), (0.8, 2.0), (0.8, 2.0)]), staged([(9.0, 9.0), (0.0, 1.0), (0.0, 1.0)]), 0.0),
              (staged([(9.0, 9.0), (1.0, 3.0), (1.0, 3.0)]), staged([(9.0, 9.0), (0.0, 0.5), (0.0, 0.5)]), 0.0)]
    row = frameworks.summarise("nemo_rl", SPEC, rounds)
    assert row["stages_s"] == {"prep": [0.9, 0.0], "train": [2.5, 0.75]}
    assert frameworks.summarise("verl", SPEC, [(_run([1.0, 2.0]), _run([1.0, 1.0]), 0.0)])["stages_s"] is None
    meta = {"date": "d", "rounds": 2, "cpu_count": 2, "workload": "w", "command": "c"}
    assert "NeMo-RL 9.9 per stage, s/step off → on: `prep` 0.900 → 0.000, `train` 2.500 → 0.750." in report.table(
        meta, [row])
