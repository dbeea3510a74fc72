"""verl through its real entry point: ``python -m verl.trainer.main_ppo algorithm.adv_estimator=grpo``,
patched (``GRPO_PATCHES=verl``) vs unpatched, on CPU (the compat matrix's end-to-end tier).

Both of verl's trainers (the V1 one with TransferQueue, verl 0.9's default, and the legacy
``RayPPOTrainer``: ``trainer.use_v1=False``), 3 optimizer steps of a tiny Qwen2 in fp32 with
SGD, KL loss on at coefficient 0, 1 and 2 mini-batches per step, half the prompts giving every
sample the same reward (their rows have advantage exactly 0). Completions come from a CPU
stand-in rollout registered through verl's own extension points (:mod:`verl_e2e_plugin`,
:mod:`verl_e2e_rollout`), seeded by (step, prompt, sample), so both runs train on the same
rollouts. Each comparison: per-step ``actor/pg_loss`` (against the advantages' scale: it
cancels to ~1e-8 on some steps) and ``actor/grad_norm`` within 1e-5, the final actor weights
within 1e-5, the savings in verl's own metrics, and ``grpo_patches.status()`` from the worker
that trained naming what ran. A Ray cluster of the module's own runs every training.

CI makes the core runs (both trainers with 1 mini-batch, the legacy one with 2: its minimal
old-logprob pass; 6 trainings); the V1
1-mini-batch one runs verify mode on every step (``verify_every=1``: every check of the worker
through the real entry point, with the same comparisons against the unpatched run);
``GRPO_E2E_FULL=1`` adds the V1 trainer's 2-mini-batch minimal pass and the option variants
(``tiled_loss=True`` on verl's fused-kernel forward, ``zero_advantage_filter=True``).
"""

from __future__ import annotations

import os

import pytest

from grpo_patches_testing import verl_actor_runs as verl_harness

if verl_harness.VERL is None:
    pytest.skip("verl is not installed (the compat cells install it)", allow_module_level=True)

from packaging.version import Version  # noqa: E402

if Version(verl_harness.VERL) < Version("0.9"):
    pytest.skip("the end-to-end tier runs verl 0.9's main_ppo (the CPU stand-in rollout uses its registries)",
                allow_module_level=True)
pytest.importorskip("ray")
pytest.importorskip("transfer_queue")

import torch  # noqa: E402

from grpo_patches_testing import verl_main_ppo as e2e  # noqa: E402

TOL = 1e-5
FULL = os.environ.get("GRPO_E2E_FULL", "") not in ("", "0")
TRAINERS = {"v1": True, "legacy": False}


@pytest.fixture(scope="module")
def cluster():
    ray = e2e.RayCluster()
    try:
        yield ray
    finally:
        ray.stop()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return e2e.build_assets(tmp_path_factory.mktemp("verl_e2e_assets"))


_RUNS: dict = {}


def run(cluster, assets, tmp_path_factory, trainer: str, mini: int, patches: dict | None, fused: bool = False):
    """One main_ppo run (each configuration once per module: the unpatched baselines are shared)."""
    key = (trainer, mini, None if patches is None else tuple(sorted(patches.items())), fused)
    if key not in _RUNS:
        out = tmp_path_factory.mktemp(f"{trainer}-{mini}-{'on' if patches is not None else 'off'}")
        _RUNS[key] = e2e.train(assets, cluster, out, v1=TRAINERS[trainer], mini_batches=mini, patches=patches,
                               fused=fused)
    return _RUNS[key]


def per_step(r: e2e.Run, name: str) -> list[float]:
    assert all(name in m for m in r.metrics), f"{name} missing from verl's metrics: {sorted(r.metrics[0])}"
    return [float(m[name]) for m in r.metrics]


def moved(r: e2e.Run, assets) -> float:
    """How far the run's final weights are from the initial ones (relative): it trained."""
    from safetensors.torch import load_file

    start = load_file(os.path.join(assets.model, "model.safetensors"))
    keys = [k for k in start if k in r.weights]
    assert keys, (sorted(start)[:3], sorted(r.weights)[:3])
    diff = torch.cat([(r.weights[k].double() - start[k].double()).flatten() for k in keys])
    return float(diff.norm() / torch.cat([start[k].double().flatten() for k in keys]).norm())


def compare(got: e2e.Run, ref: e2e.Run, record_property, label: str, assets=None) -> None:
    """Patched vs unpatched: the same steps, losses, gradient norms and final weights."""
    assert len(got.metrics) == len(ref.metrics) == e2e.STEPS
    # the same rollouts and rewards at every step (the stand-in is seeded; verl scores them)
    assert per_step(got, "critic/score/mean") == per_step(ref, "critic/score/mean")
    scale = [max(abs(m["critic/advantages/max"]), abs(m["critic/advantages/min"])) for m in ref.metrics]
    loss_err = max(abs(a - b) / s for a, b, s in zip(per_step(got, "actor/pg_loss"), per_step(ref, "actor/pg_loss"),
                                                     scale))
    norm_err = max(abs(a - b) / abs(b) for a, b in zip(per_step(got, "actor/grad_norm"),
                                                        per_step(ref, "actor/grad_norm")))
    diff = torch.cat([(got.weights[k].double() - ref.weights[k].double()).flatten() for k in ref.weights])
    weight_err = float(diff.norm() / torch.cat([v.double().flatten() for v in ref.weights.values()]).norm())
    record_property(f"exact_e2e_{label}_pg_loss", loss_err)
    record_property(f"exact_e2e_{label}_grad_norm_rel", norm_err)
    record_property(f"exact_e2e_{label}_weights_rel", weight_err)
    assert loss_err <= TOL and norm_err <= TOL and weight_err <= TOL, (label, loss_err, norm_err, weight_err)
    if assets is not None:  # equal because both trained, not because neither did
        assert moved(ref, assets) > 100 * TOL


#: The trainings that run verify mode on every step (one of CI's own: no training of its own).
VERIFIED = {"v1": {"verify_every": 1}}
#: Verify mode's figures in verl's logged metrics (the actor's, prefixed by verl) and their bounds.
VERIFY_FIGURES = {"actor/grpo_patches/verify/grad_rel_diff": TOL,
                  "actor/grpo_patches/verify/old_logprob_max_abs_diff": TOL,
                  "actor/grpo_patches/verify/reference_loss_abs_diff": 0.0}


def check_verified(r: e2e.Run, record_property, trainer: str) -> None:
    """Every step verified in the worker: each check's figure in verl's logged metrics, within bounds."""
    for name, bound in VERIFY_FIGURES.items():
        values = per_step(r, name)
        assert max(values) <= bound, (name, values)
        record_property(f"exact_e2e_{trainer}_verify_{name.rsplit('/', 1)[1]}", max(values))
    verified = worker_status(r)["verify"]
    assert verified["steps_verified"] == e2e.STEPS and not verified["failures"], verified


def worker_status(r: e2e.Run) -> dict:
    status = r.status
    assert status["patched"] and f"pid {os.getpid()} " not in status["process"]  # the training worker's own
    return status


@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_on_policy_steps_skip_the_old_logprob_pass(cluster, assets, tmp_path_factory, record_property, trainer):
    """One mini-batch per step: the old-logprob and reference passes are skipped, the
    zero-advantage rows dropped, and training is verl's own. The V1 run also verifies every
    step (``verify_every=1``): the checks pass, log their figures, and change nothing."""
    ref = run(cluster, assets, tmp_path_factory, trainer, 1, None)
    got = run(cluster, assets, tmp_path_factory, trainer, 1, VERIFIED.get(trainer, {}))
    compare(got, ref, record_property, f"{trainer}_1mb", assets)  # a verify step leaves no trace
    if trainer in VERIFIED:
        check_verified(got, record_property, trainer)
    for m in got.metrics:
        assert m["actor/grpo_patches/old_log_probs_substituted"] == 1.0  # the worker replaced the placeholder
        assert m["grpo_patches/old_logprob_passes_skipped"] == 1.0
        assert m["actor/grpo_patches/reference_passes_skipped"] == 1.0
        assert m["actor/grpo_patches/rows_dropped"] > 0
        assert "timing_s/ref" not in m  # no reference pass ran
    assert all("timing_s/ref" in m for m in ref.metrics)
    rows = [m["actor/grpo_patches/rows_dropped"] for m in got.metrics]
    status = worker_status(got)
    assert status["savings"]["old_logprob_substituted_updates"] == e2e.STEPS
    assert status["savings"]["rows_dropped"] == sum(rows)
    notes = {k: v for c in status["by_class"].values() for k, v in c.items()}
    assert notes["zero_advantage_filter"].startswith("on"), notes
    record_property(f"e2e_{trainer}_rows_dropped", sum(rows))
    print(f"{trainer}: {ref.seconds:.0f} s unpatched, {got.seconds:.0f} s patched; rows dropped per step {rows}")


@pytest.mark.parametrize("trainer", [pytest.param(t, marks=pytest.mark.skipif(
    t == "v1" and not FULL, reason="the V1 variant: GRPO_E2E_FULL=1")) for t in TRAINERS])
def test_two_mini_batches_run_the_minimal_pass(cluster, assets, tmp_path_factory, record_property, trainer):
    """Two mini-batches per step: the old log-probs are read after the first optimizer step.
    Both trainers run the pass only on the rows a loss reads then (the second mini-batch's
    non-zero-advantage rows: ``recompute``; the V1 trainer by TransferQueue keys), the workers
    substitute the others. Rows are dropped, and training is verl's own."""
    ref = run(cluster, assets, tmp_path_factory, trainer, 2, None)
    got = run(cluster, assets, tmp_path_factory, trainer, 2, {})
    compare(got, ref, record_property, f"{trainer}_2mb", assets)
    rows = e2e.TESTS.prompts * e2e.TESTS.samples
    for m in got.metrics:
        assert "grpo_patches/old_logprob_passes_skipped" not in m  # the pass ran (on some rows)
        assert m["actor/grpo_patches/rows_dropped"] > 0
    skipped = [m["grpo_patches/old_logprob_rows_skipped"] for m in got.metrics]
    assert all(rows // 2 <= s < rows for s in skipped), skipped  # at least the first mini-batch's rows
    for m in got.metrics:
        assert m["actor/grpo_patches/old_log_probs_substituted"] == 1.0
    assert worker_status(got)["savings"]["old_logprob_substituted_updates"] == e2e.STEPS
    # the kept rows in fewer forward/backward calls (micro-batches of 4 rows, 8 rows per mini-batch), counted
    saved = worker_status(got)["savings"].get("micro_batches_dropped", 0)
    assert 0 < saved == ref.policy_calls - got.policy_calls, (saved, ref.policy_calls, got.policy_calls)
    record_property(f"e2e_{trainer}_policy_calls", [ref.policy_calls, got.policy_calls])
    record_property(f"e2e_{trainer}_old_logprob_rows_skipped", sum(skipped))
    record_property(f"e2e_{trainer}_old_logprob_rows_computed_vs_upstream", 1 - sum(skipped) / (rows * e2e.STEPS))


@pytest.mark.skipif(not FULL, reason="option variants: GRPO_E2E_FULL=1")
@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_tiled_loss_on_the_fused_forward(cluster, assets, tmp_path_factory, record_property, trainer):
    ref = run(cluster, assets, tmp_path_factory, trainer, 1, None, fused=True)
    got = run(cluster, assets, tmp_path_factory, trainer, 1, {"tiled_loss": 1}, fused=True)
    compare(got, ref, record_property, f"{trainer}_tiled", assets)
    assert worker_status(got)["savings"].get("tiled_loss_micro_batches", 0) > 0


@pytest.mark.skipif(not FULL, reason="option variants: GRPO_E2E_FULL=1")
@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_zero_advantage_filter_true(cluster, assets, tmp_path_factory, record_property, trainer):
    ref = run(cluster, assets, tmp_path_factory, trainer, 2, None)
    got = run(cluster, assets, tmp_path_factory, trainer, 2, {"zero_advantage_filter": 1, "logprob_skip": 0})
    compare(got, ref, record_property, f"{trainer}_filter", assets)
    assert all(m["actor/grpo_patches/rows_dropped"] > 0 for m in got.metrics)
