"""The NeMo-RL adapter on the driver: ``grpo.setup`` + ``grpo_train`` of every tag's stand-in, patched vs not.

The stand-in's ``grpo_train`` calls ``Policy`` the way each tag does (the passes, the
placeholders, the logging); its ``Policy`` runs one in-process worker. Exactness: the weights
after every step are those of unpatched NeMo-RL; work saved: the passes that did not run.
"""

from __future__ import annotations

import pytest
import torch

import grpo_patches
from grpo_patches import savings
from grpo_patches.adapters.nemo_rl.honest_logs import PLACEHOLDER_METRICS
from tests.helpers.nemo_fake import TAGS, master_config
from tests.helpers.nemo_worker_harness import make_batch, rel

TOL = 1e-6
STEPS = 2


def _rollouts(rows: int = 8) -> list[dict]:
    return [make_batch(rows=rows, seed=seed, zero_rows=(1, 2)) for seed in range(STEPS)]


def _run(tag: str, options: dict | None, *, loss: dict | None = None, grpo: dict | None = None,
         policy: dict | None = None, rows: int = 8, adjust=None):
    """setup + grpo_train; returns (policy, logger, final weights). ``adjust(policy)`` runs in between."""
    from nemo_rl.algorithms import grpo as grpo_module
    from nemo_rl.models.tiny import TinyLM
    from nemo_rl.utils.logger import Logger

    if options is not None:
        grpo_patches.enable("nemo_rl", **options)
    config = master_config(tag, loss=loss, grpo=grpo, policy={"model_factory": TinyLM, **(policy or {})})
    policy_obj, _, _, _, _, loss_fn, *_ = grpo_module.setup(config, None, None, None)
    if adjust is not None:
        adjust(policy_obj)
    logger = Logger()
    grpo_module.grpo_train(policy_obj, None, _rollouts(rows), None, None, loss_fn, None, None, logger, None, None,
                           config)
    weights = torch.cat([p.detach().reshape(-1) for p in policy_obj.worker.model.parameters()])
    return policy_obj, logger, weights


def _compare(tag: str, fake_nemo, options: dict, **kw):
    fake_nemo(tag)
    base = _run(tag, None, **kw)
    patched = _run(tag, options, **kw)
    report = grpo_patches.status()["nemo_rl"]
    return base, patched, report


@pytest.mark.parametrize("tag", TAGS)
def test_prev_pass_skipped_when_on_policy(fake_nemo, tag, record_property):
    (policy0, log0, w0), (policy1, log1, w1), report = _compare(tag, fake_nemo, {"zero_advantage_filter": False})
    diff = rel(w1, w0)
    record_property("exact_prev_skip_weights_rel", diff)
    assert diff <= TOL
    assert policy0.calls["get_logprobs"] == STEPS and policy1.calls["get_logprobs"] == 0
    assert report["savings"]["old_logprob_passes_skipped"] == STEPS
    assert report["notes"]["old_logprob_pass"].startswith("skipped: provably on-policy")
    metrics0, metrics1 = dict(log0.metrics[-1][1]), dict(log1.metrics[-1][1])
    assert metrics1["token_mult_prob_error"] == pytest.approx(metrics0["token_mult_prob_error"], rel=1e-5)
    assert not set(PLACEHOLDER_METRICS) & set(metrics1)  # never logged as if real
    assert all("prev_logprobs" not in row for row in log1.jsonl) and log1.plots == []
    assert [m["grpo_patches/old_logprob_passes_skipped"] for _, m in log1.metrics] == [1.0] * STEPS  # NeMo-RL logs it


def _overriding_train(policy) -> None:
    class WithOwnTrain(type(policy)):
        def train(self, *args, **kwargs):
            return super().train(*args, **kwargs)

    policy.__class__ = WithOwnTrain


@pytest.mark.parametrize("tag", TAGS)
def test_prev_pass_runs_for_a_policy_that_overrides_train(fake_nemo, tag):
    """The skip is exact only through the patched ``Policy.train`` (it puts the loss on its
    on-policy path): a subclass's own ``train`` might not call it, so the pass runs."""
    (_, _, w0), (policy1, log1, w1), report = _compare(tag, fake_nemo, {"zero_advantage_filter": False},
                                                       adjust=_overriding_train)
    assert policy1.calls["get_logprobs"] == STEPS and rel(w1, w0) <= TOL
    assert "WithOwnTrain.train overrides Policy.train" in report["notes"]["old_logprob_pass"]
    assert "old_logprob_passes_skipped" not in report["savings"]


@pytest.mark.parametrize("tag", ["v0.6.0", "main"])
def test_a_skipped_batch_trained_by_another_policy_is_an_error(fake_nemo, tag):
    """The zero placeholder must never reach a loss: another Policy's train call cannot be put on
    the on-policy path for this step."""
    import copy

    from grpo_patches.errors import GrpoPatchesError

    def other_trains(policy) -> None:
        policy.train = copy.copy(policy).train

    fake_nemo(tag)
    with pytest.raises(GrpoPatchesError, match="zero placeholder"):
        _run(tag, {"zero_advantage_filter": False}, adjust=other_trains)


@pytest.mark.parametrize("tag", TAGS)
def test_prev_pass_runs_when_something_else_reads_it(fake_nemo, tag):
    (policy0, _, w0), (policy1, _, w1), report = _compare(
        tag, fake_nemo, {}, loss={"use_importance_sampling_correction": True})
    assert policy1.calls["get_logprobs"] == STEPS and rel(w1, w0) == 0.0
    assert "use_importance_sampling_correction" in report["notes"]["old_logprob_pass"]
    assert "old_logprob_passes_skipped" not in report["savings"]


@pytest.mark.parametrize("tag", TAGS)
def test_two_optimizer_steps_per_rollout_keep_the_pass(fake_nemo, tag):
    (_, _, w0), (policy1, log1, w1), report = _compare(tag, fake_nemo, {}, policy={"train_global_batch_size": 4})
    assert policy1.calls["get_logprobs"] == STEPS and rel(w1, w0) <= TOL  # the filter regroups rows: rounding
    assert "make 2 optimizer steps" in report["notes"]["old_logprob_pass"]
    assert [m["grpo_patches/old_logprob_passes_skipped"] for _, m in log1.metrics] == [0.0] * STEPS


@pytest.mark.parametrize("tag", TAGS)
def test_every_train_call_is_checked(fake_nemo, tag, record_property):
    """The config promises one step per rollout, but a rollout batch arrives twice as large: the
    pass runs — v0.5 / v0.6 see the rows at the pass itself, v0.7+ only at train time (before the
    weights move, so it computes what the skipped pass would have)."""
    (_, _, w0), (policy1, _, w1), report = _compare(tag, fake_nemo, {"zero_advantage_filter": False}, rows=16)
    diff = rel(w1, w0)
    record_property("exact_prev_late_pass_weights_rel", diff)
    assert diff <= TOL
    assert policy1.calls["get_logprobs"] == STEPS
    note = report["notes"]["old_logprob_pass"]
    if tag in ("v0.5.0", "v0.6.0"):
        assert note.startswith("runs: 16 rows per step make 2 optimizer steps (train_global_batch_size=8)")
    else:
        assert note.startswith("run at train time: this train call makes 2 optimizer steps")
    assert "old_logprob_passes_skipped" not in report["savings"]


@pytest.mark.parametrize("tag", ["v0.7.0", "main"])
def test_upstream_force_on_policy_ratio_counts_nothing(fake_nemo, tag):
    (policy0, _, w0), (policy1, log1, w1), report = _compare(tag, fake_nemo, {},
                                                             loss={"force_on_policy_ratio": True})
    assert policy0.calls["get_logprobs"] == policy1.calls["get_logprobs"] == 0 and rel(w1, w0) == 0.0
    assert "old_logprob_passes_skipped" not in report["savings"]
    assert not set(PLACEHOLDER_METRICS) & set(log1.metrics[-1][1])


@pytest.mark.parametrize("tag", ["v0.5.0", "v0.6.0"])
def test_reference_model_not_built_at_kl_zero(fake_nemo, tag):
    (policy0, _, w0), (policy1, _, w1), report = _compare(tag, fake_nemo, {"zero_advantage_filter": False})
    assert policy0.worker.reference is not None and policy1.worker.reference is None
    assert rel(w1, w0) == 0.0
    assert report["savings"]["reference_models_not_built"] == 1
    assert report["savings"]["reference_passes_skipped"] == STEPS
    assert policy0.calls["get_reference_policy_logprobs"] == STEPS
    assert report["notes"]["reference_pass"].startswith("skipped (reference model not built")


@pytest.mark.parametrize("tag", TAGS)
def test_reference_kept_with_a_kl_penalty(fake_nemo, tag):
    (_, _, w0), (policy1, _, w1), report = _compare(tag, fake_nemo, {"zero_advantage_filter": False},
                                                    loss={"reference_policy_kl_penalty": 0.05})
    assert policy1.worker.reference is not None and rel(w1, w0) == 0.0
    assert report["notes"]["reference_pass"].startswith("runs: loss_fn.reference_policy_kl_penalty=0.05 non-zero")


@pytest.mark.parametrize("tag", ["v0.7.0", "main"])
def test_reference_skip_is_upstream_from_v070(fake_nemo, tag):
    _, (policy1, _, _), report = _compare(tag, fake_nemo, {})
    assert policy1.worker.reference is None
    assert report["notes"]["reference_pass"].startswith("skipped by NeMo-RL itself")
    assert "reference_models_not_built" not in report["savings"]


@pytest.mark.parametrize("tag", TAGS)
def test_filter_and_prev_skip_together(fake_nemo, tag, record_property):
    (_, log0, w0), (_, log1, w1), report = _compare(tag, fake_nemo, {"zero_advantage_filter": True})
    diff = rel(w1, w0)
    record_property("exact_prev_skip_and_filter_weights_rel", diff)
    assert diff <= TOL
    metrics = log1.metrics[-1][1]
    assert metrics["grpo_patches/rows_dropped"] == 2
    assert report["notes"]["zero_advantage_filter_workers"].startswith(f"the workers left out {2 * STEPS} rows")
    # on-policy: token_mult_prob_error needs the dropped rows' forward -> kept rows, under a name that says so
    assert "token_mult_prob_error" not in metrics and "token_mult_prob_error/kept_rows" in metrics


def test_workers_not_reached_drop_metrics_of_zero_prev(fake_nemo, monkeypatch):
    """A v0.5 / v0.6 worker without grpo_patches keeps the exact gradient (force flag) but
    computes its prev-vs-generation metrics from zeros: the driver drops them."""
    from grpo_patches.adapters.nemo_rl import loss_call

    fake_nemo("v0.6.0")
    monkeypatch.setattr(loss_call, "call_v060", lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs))
    base = _run("v0.6.0", None)
    patched = _run("v0.6.0", {"zero_advantage_filter": False})
    assert rel(patched[2], base[2]) <= TOL
    logged = patched[1].metrics[-1][1]
    assert not {"token_mult_prob_error", "gen_kl_error", "sampling_importance_ratio"} & set(logged)
    assert "token_mult_prob_error" in base[1].metrics[-1][1]
    assert grpo_patches.status()["nemo_rl"]["notes"]["workers"].startswith("not reached: prev-logprob metrics")


def test_driver_options_the_workers_would_not_get_are_an_error(fake_nemo, monkeypatch, tmp_path):
    from grpo_patches.errors import OptionError

    fake_nemo("v0.7.0")
    monkeypatch.setenv("GRPO_PATCHES", "nemo_rl")
    monkeypatch.setenv("GRPO_PATCHES_STARTUP_DIR", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("GRPO_PATCHES_OPTIONS", "")
    with pytest.raises(OptionError, match=r"sets tiled_loss=True, but the Ray workers read their options from "
                                          r"GRPO_PATCHES_OPTIONS=''"):
        _run("v0.7.0", {"tiled_loss": True})
    grpo_patches.disable()
    monkeypatch.setenv("GRPO_PATCHES_OPTIONS", "tiled_loss=1")
    _run("v0.7.0", {"tiled_loss": True})
    assert grpo_patches.status()["nemo_rl"]["notes"]["workers"].startswith("reached through the start-up directory")


def test_filter_true_with_a_kl_penalty_fails_in_setup(fake_nemo):
    from grpo_patches.errors import IncompatibleOptionsError

    fake_nemo("v0.7.0")
    with pytest.raises(IncompatibleOptionsError, match="zero_advantage_filter=True: the zero-advantage filter needs "
                                                       r"loss_fn.reference_policy_kl_penalty == 0 \(got 0.1\)"):
        _run("v0.7.0", {"zero_advantage_filter": True}, loss={"reference_policy_kl_penalty": 0.1})
    assert savings.totals("nemo_rl") == {}


@pytest.mark.parametrize("tag", TAGS)
def test_async_loop_keeps_the_prev_pass_and_says_so(fake_nemo, tag):
    """The async loop is never provably on-policy: it runs as it is, and status() says why."""
    fake_nemo(tag)
    from nemo_rl.algorithms import grpo as grpo_module

    grpo_patches.enable("nemo_rl", zero_advantage_filter=False)
    assert grpo_module.async_grpo_train() == "async loop ran"
    note = grpo_patches.status()["nemo_rl"]["notes"]["old_logprob_pass"]
    assert note.startswith("runs: async_grpo_train trains on trajectories that older weights may have generated")
    assert "old_logprob_passes_skipped" not in grpo_patches.status()["nemo_rl"]["savings"]


def _reached(monkeypatch, tmp_path, options: str = "") -> None:
    """The driver's environment as `grpo-patches run` leaves it (the workers get grpo_patches)."""
    monkeypatch.setenv("GRPO_PATCHES", "nemo_rl")
    monkeypatch.setenv("GRPO_PATCHES_STARTUP_DIR", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("GRPO_PATCHES_OPTIONS", options)


@pytest.mark.parametrize("tag", TAGS)
def test_several_optimizer_steps_defer_the_pass_to_the_rows_it_needs(fake_nemo, tag, monkeypatch, tmp_path,
                                                                     record_property):
    """16 rows, 4 global batches: the first 4 rows (the first optimizer step) skip the pass;
    the deferred pass at Policy.train runs on the other 12 (the zero rows 1, 2 are among the first)."""
    _reached(monkeypatch, tmp_path)
    (_, log0, w0), (policy1, log1, w1), report = _compare(tag, fake_nemo, {}, policy={"train_global_batch_size": 4},
                                                          rows=16)
    diff = rel(w1, w0)
    record_property("exact_prev_rows_weights_rel", diff)
    assert diff <= TOL
    assert policy1.calls["get_logprobs"] == STEPS
    assert [m["grpo_patches/old_logprob_rows_skipped"] for _, m in log1.metrics] == [4.0] * STEPS
    assert report["savings"]["old_logprob_rows_skipped"] == 4 * STEPS
    assert report["notes"]["old_logprob_pass"].startswith("deferred to Policy.train and run only on the rows")
    assert not set(PLACEHOLDER_METRICS) & set(log1.metrics[-1][1])


def _steps(log: list[str]) -> list[list[str]]:
    """A Policy's call log cut after each ``train``."""
    steps, current = [], []
    for name in log:
        current.append(name)
        if name == "train":
            steps.append(current)
            current = []
    return steps


@pytest.mark.parametrize("tag", TAGS)
def test_the_deferred_pass_runs_without_the_inference_bracket(fake_nemo, tag, monkeypatch, tmp_path):
    """The deferred pass runs right after grpo_train's own prepare_for_training: NeMo-RL's inference
    bracket around it would only call prepare_for_training a second time (the workers' get_logprobs
    sets eval mode, train() sets train mode: tests/compat_nemo_rl/test_real_prev_rows.py); it stays
    where it frees memory (offload_optimizer_for_logprob; the Megatron worker: pass_bracket)."""
    _reached(monkeypatch, tmp_path)
    (policy0, _, w0), (policy1, _, w1), report = _compare(tag, fake_nemo, {}, policy={"train_global_batch_size": 4},
                                                          rows=16)
    assert rel(w1, w0) <= TOL
    upstream = ["get_logprobs", "prepare_for_training", "train"]
    if tag in ("v0.7.0", "main"):
        upstream.insert(0, "prepare_for_lp_inference")
    assert _steps(policy0.log) == [upstream] * STEPS
    assert _steps(policy1.log) == [["prepare_for_training", "get_logprobs", "train"]] * STEPS
    assert report["notes"]["old_logprob_pass"].endswith("without NeMo-RL's inference bracket (the workers set eval "
                                                        "mode themselves)")
    grpo_patches.disable()
    policy2, _, w2 = _run(tag, {}, rows=16, policy={"train_global_batch_size": 4, "offload_optimizer_for_logprob": True})
    report = grpo_patches.status()["nemo_rl"]
    assert rel(w2, w0) <= TOL
    assert _steps(policy2.log) == [["prepare_for_training", "prepare_for_lp_inference", "get_logprobs",
                                    "prepare_for_training", "train"]] * STEPS
    assert "in NeMo-RL's inference bracket (policy.offload_optimizer_for_logprob" in report["notes"]["old_logprob_pass"]


@pytest.mark.parametrize("tag", ["v0.6.0", "main"])
def test_recompute_false_keeps_every_row(fake_nemo, tag, monkeypatch, tmp_path):
    _reached(monkeypatch, tmp_path, "recompute=0")
    (_, _, w0), (policy1, log1, w1), report = _compare(tag, fake_nemo, {"recompute": False},
                                                       policy={"train_global_batch_size": 4}, rows=16)
    assert rel(w1, w0) <= TOL and policy1.calls["get_logprobs"] == STEPS
    assert "recompute=False" in report["notes"]["old_logprob_pass"]
    assert "old_logprob_rows_skipped" not in report["savings"]
    assert [m["grpo_patches/old_logprob_rows_skipped"] for _, m in log1.metrics] == [0.0] * STEPS
