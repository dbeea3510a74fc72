"""NeMo-RL's GRPO entry point end to end, patched vs unpatched: ``examples/run_grpo.py`` as a user runs it.

Each run is NeMo-RL's own ``examples/run_grpo.py`` with its example config and command-line
overrides (:mod:`grpo_patches_testing.nemo_rl_run_grpo`): the synchronous ``grpo_train``, the DTensor policy
worker v2 as a real Ray actor in its own venv (found by NeMo-RL's venv lookup), the math
environment's Ray actors, NeMo-RL's logger (tensorboard). Patched runs start it the way the
README says, ``grpo-patches run --frameworks nemo_rl --options ... -- python examples/run_grpo.py
...``: the worker gets grpo_patches only through the start-up directory on ``PYTHONPATH``. A
start-up hook (``tests/grpo-patches-testing/grpo_patches_testing/nemo_rl_startup/``) stands in for CUDA and vLLM.

Cases (3 steps, 4 prompts x 4 samples, half the rows at advantage exactly 0, KL penalty 0,
fp32, SGD): one optimizer step per rollout batch with the default options (prev-logprob pass
skipped, zero-advantage filter ``"auto"``); two optimizer steps per batch (the pass runs on the
second global batch's rows with a non-zero advantage only); one
step with ``tiled_loss=True`` and ``zero_advantage_filter=True``. The first and the last run
with ``verify_every=1`` too: verify mode's figures on every step, within tolerance, and the run
still equal to the unpatched one (a verify step leaves no trace besides its figures). Each against the unpatched run
of the same config: NeMo-RL's logged loss and grad norm per step and the final weights within
``TOL`` (relative), the savings in NeMo-RL's own metrics, ``status()`` from the worker process.
"""

from __future__ import annotations

import importlib.util
import math

import pytest

from grpo_patches_testing import nemo_rl_cpu as harness
from grpo_patches_testing import nemo_rl_run_grpo as e2e

TAG = harness.tag()
if TAG not in ("v0.7.0", "main"):
    pytest.skip(f"not run: the end-to-end cell runs NeMo-RL v0.7.0 and main (this source is {TAG}: its worker needs "
                "another environment than its driver's)", allow_module_level=True)
harness.need_worker()
for _module in ("ray", "tensorboard", "math_verify"):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"not run: {_module} is not installed (the NeMo-RL cell's environment has it)",
                    allow_module_level=True)

TOL = 1e-5
DEFAULTS = ""  # grpo-patches run --options "": every option at its default
FORCED = "tiled_loss=1,zero_advantage_filter=1"
VERIFY = "verify_every=1"  # verify mode on every step of a patched run: it must leave no trace besides its figures
ROWS, ZERO_ROWS, STEPS = e2e.CELL.rows, e2e.CELL.zero_rows, e2e.CELL.steps  # zero rows: uniform groups (advantage 0)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``run(name, train_batch, options)``: one run of ``examples/run_grpo.py`` (cached), all on one
    Ray cluster of this module, stopped at its end."""
    source = e2e.source_root()
    if not (source / "examples" / "run_grpo.py").exists():
        pytest.skip(f"not run: {source} has no examples/run_grpo.py (compat/sources.py exports it with the package)")
    root = tmp_path_factory.mktemp("nemo_e2e")
    files = e2e.assets(root)
    venvs = root / "venvs"
    e2e.worker_venv(venvs)
    done: dict[str, e2e.Run] = {}
    with e2e.RayCluster() as cluster:
        def one(name: str, train_batch: int, options: str | None) -> e2e.Run:
            if name not in done:
                done[name] = e2e.run_grpo(source, root / name, cluster, venvs, files, train_batch, options)
                assert done[name].returncode == 0, f"{name}: exit {done[name].returncode}\n{done[name].output[-6000:]}"
            return done[name]

        yield one


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _compare(base: e2e.Run, patched: e2e.Run, label: str, record_property) -> None:
    """NeMo-RL's logged loss and grad norm per step, and the final weights, within TOL."""
    import torch

    for tag in ("train/loss", "train/grad_norm"):
        ours, theirs = patched.step_values(tag), base.step_values(tag)
        assert len(ours) == len(theirs) == STEPS, (tag, ours, theirs)
        worst = max(_rel(a, b) for a, b in zip(ours, theirs))
        record_property(f"exact_e2e_{label}_{tag.split('/')[1]}_rel", worst)
        assert worst <= TOL, (tag, ours, theirs)
    first = torch.load(base.weights.parent / "weights-0.pt")
    ours, theirs = torch.load(patched.weights), torch.load(base.weights)
    assert set(ours) == set(theirs) == set(first)
    flat = {name: torch.cat([w[k].double().reshape(-1) for k in sorted(w)]) for name, w in
            (("ours", ours), ("theirs", theirs), ("first", first))}
    weights_rel = float((flat["ours"] - flat["theirs"]).norm() / flat["theirs"].norm())
    update_rel = float((flat["ours"] - flat["theirs"]).norm() / (flat["theirs"] - flat["first"]).norm())
    record_property(f"exact_e2e_{label}_weights_rel", weights_rel)
    record_property(f"e2e_{label}_update_rel", update_rel)
    record_property(f"e2e_{label}_seconds", f"{base.seconds:.0f} unpatched, {patched.seconds:.0f} patched")
    assert weights_rel <= TOL and update_rel <= 1e-3, (weights_rel, update_rel)


def _worker_report(run_: e2e.Run) -> dict:
    """``grpo_patches.status()`` of the worker process, as the worker itself wrote it after its last train call."""
    last = run_.worker[-1]["grpo_patches"]
    assert last["importable"], "grpo_patches did not reach the worker"
    return last["status"]["nemo_rl"]


def _unpatched_saw_nothing(base: e2e.Run) -> None:
    assert base.worker and not any(w["grpo_patches"]["importable"] for w in base.worker)  # the worker venv lacks it
    assert not [k for k in base.scalars if "grpo_patches" in k]


def test_one_optimizer_step_per_rollout(run, record_property):
    """Default options: the prev-logprob pass is skipped (provably on-policy) and the zero-advantage
    rows never reach the worker's forward or backward."""
    base, patched = run("unpatched-1step", ROWS, None), run("patched-1step", ROWS, VERIFY)
    _compare(base, patched, "one_step", record_property)
    _verified(patched, ("grad_rel_diff", "old_logprob_max_abs_diff"), record_property, "one_step")
    _unpatched_saw_nothing(base)
    assert patched.step_values("train/grpo_patches/rows_dropped") == [ZERO_ROWS] * STEPS
    assert patched.step_values("train/grpo_patches/old_logprob_passes_skipped") == [1.0] * STEPS
    # NeMo-RL's own timers: it prepared the workers for a log-prob pass only when one ran
    assert "timing/train/logprob_inference_prep" in base.scalars
    assert "timing/train/logprob_inference_prep" not in patched.scalars
    worker = _worker_report(patched)
    assert worker["notes"]["zero_advantage_filter"] == "on" and worker["patched"]
    assert worker["process"] != _driver_report(patched)["process"]
    assert worker["savings"]["rows_dropped"] >= ZERO_ROWS  # the last call's rows are reported after the record
    driver = _driver_report(patched)
    assert driver["notes"]["old_logprob_pass"].startswith("skipped: provably on-policy")
    assert driver["notes"]["workers"].startswith("reached through the start-up directory")
    assert driver["savings"]["old_logprob_passes_skipped"] == STEPS
    record_property("e2e_rows_dropped_per_step", f"{ZERO_ROWS} of {ROWS}")


def test_two_optimizer_steps_per_rollout(run, record_property):
    """Two optimizer steps per rollout batch (``recompute``, on by default): the prev-logprob pass is
    deferred to ``Policy.train`` and runs only on the second global batch's rows with a non-zero
    advantage; the filter drops the zero-advantage rows of both global batches."""
    base, patched = run("unpatched-2steps", ROWS // 2, None), run("patched-2steps", ROWS // 2, DEFAULTS)
    _compare(base, patched, "two_steps", record_property)
    _unpatched_saw_nothing(base)
    assert patched.step_values("train/grpo_patches/rows_dropped") == [ZERO_ROWS] * STEPS
    assert patched.step_values("train/grpo_patches/old_logprob_passes_skipped") == [0.0] * STEPS
    skipped = patched.step_values("train/grpo_patches/old_logprob_rows_skipped")
    assert len(skipped) == STEPS and all(ROWS // 2 <= v < ROWS for v in skipped), skipped  # the first 8, and more
    record_property("e2e_two_steps_prev_rows_computed", f"{[ROWS - int(v) for v in skipped]} of {ROWS} per step")
    driver = _driver_report(patched)
    assert driver["notes"]["old_logprob_pass"].startswith("deferred to Policy.train and run only on the rows")
    assert driver["notes"]["old_logprob_pass"].endswith("without NeMo-RL's inference bracket (the workers set eval "
                                                        "mode themselves)")
    assert driver["savings"]["old_logprob_rows_skipped"] == sum(skipped)
    # the worker's own forwards per step (beneath the patches): the pass in whole logprob_batch_size calls, once
    calls = [(w["forwards"]["no_grad"][0], w["forwards"]["grad"][0]) for w in patched.worker]
    upstream = [(w["forwards"]["no_grad"][0], w["forwards"]["grad"][0]) for w in base.worker]
    assert upstream == [(ROWS // e2e.CELL.micro_batch, ROWS // e2e.CELL.micro_batch)] * STEPS, upstream
    assert [no_grad for no_grad, _ in calls] == [math.ceil((ROWS - v) / e2e.CELL.micro_batch) for v in skipped], calls
    assert all(grad <= ROWS // e2e.CELL.micro_batch for _, grad in calls), calls
    record_property("e2e_two_steps_calls_per_step", f"(pass, train) {upstream[0]} -> {calls}")
    assert "old_logprob_passes_skipped" not in driver["savings"]


def test_tiled_loss_and_filter_forced_on(run, record_property):
    """``tiled_loss=True`` and ``zero_advantage_filter=True``: the loss from the last hidden state
    and the lm-head weight, tile by tile, on the kept rows only."""
    base, patched = run("unpatched-1step", ROWS, None), run("patched-tiled", ROWS, f"{FORCED},{VERIFY}")
    _compare(base, patched, "tiled_filter", record_property)
    _verified(patched, ("grad_rel_diff", "old_logprob_max_abs_diff"), record_property, "tiled_filter")
    assert patched.step_values("train/grpo_patches/rows_dropped") == [ZERO_ROWS] * STEPS
    worker = _worker_report(patched)
    assert worker["options"]["tiled_loss"] is True and worker["options"]["zero_advantage_filter"] is True
    assert worker["notes"]["tiled_loss"].startswith("on") and worker["notes"]["zero_advantage_filter"] == "on"
    assert all(math.isfinite(v) for v in patched.step_values("train/loss"))


def _verified(run_: e2e.Run, quantities: tuple[str, ...], record_property, label: str) -> None:
    """Verify mode ran on every step: its figures in NeMo-RL's logged metrics and both processes'
    ``status()``, within tolerance (the run itself is compared with the unpatched one by the caller)."""
    for quantity in quantities:
        values = run_.step_values(f"train/grpo_patches/verify/{quantity}")
        record_property(f"exact_e2e_{label}_verify_{quantity}", max(values, default=math.inf))
        assert len(values) == STEPS and all(0.0 <= v <= 1e-5 for v in values), (quantity, values)
    for report in (_driver_report(run_), _worker_report(run_)):
        assert report["verify"]["steps_verified"] == STEPS and report["verify"]["failures"] == [], report["verify"]
        assert set(quantities) <= set(report["verify"]["worst"])


def _driver_report(run_: e2e.Run) -> dict:
    assert run_.driver, "the driver wrote no status at exit"
    return run_.driver[-1]["grpo_patches"]["status"]["nemo_rl"]
