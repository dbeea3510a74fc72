"""Verify mode for NeMo-RL on the stand-in of every tag (:mod:`tests.helpers.nemo_fake`): the DTensor
worker's checks (:mod:`tests.helpers.nemo_verify_cases`, also run on the real source in the
compat cells) and the driver's (``grpo_train``: the skipped prev-logprob pass, switch-offs that
reach the driver, figures in NeMo-RL's logged metrics and ``status()``).
"""

from __future__ import annotations

import pytest
import torch

import grpo_patches
from grpo_patches import plugin_manager, verify_log
from grpo_patches.reference_pass import ReferencePassDecision
from grpo_patches.errors import ExactnessError, GrpoPatchesWarning, UnsupportedFrameworkError
from tests.helpers import nemo_verify_cases as cases
from tests.helpers.nemo_fake import TAGS, master_config
from tests.helpers.nemo_worker_harness import fake_worker, make_batch, rel

NEW = [t for t in TAGS if t != "v0.5.0"]
PREFIX = cases.PREFIX
STEPS = 2


@pytest.mark.parametrize("tag", NEW)
def test_verify_passes_and_leaves_no_trace(fake_nemo, tag, record_property):
    fake_nemo(tag)
    cases.verify_passes_and_leaves_no_trace(tag, fake_worker, record_property)


@pytest.mark.parametrize("tag", ["v0.6.0", "main"])
def test_verify_checks_the_tiled_loss(fake_nemo, tag, record_property):
    fake_nemo(tag)
    cases.verify_passes_and_leaves_no_trace(tag, fake_worker, record_property, tiled=True, label="tiled_")


@pytest.mark.parametrize("tag", ["v0.6.0", "main"])
def test_a_faulty_filter_is_caught_on_the_first_verify_step(fake_nemo, tag):
    fake_nemo(tag)
    cases.faulty_filter_raises(tag, fake_worker)


@pytest.mark.parametrize("tag", ["v0.6.0", "main"])
def test_disable_switches_the_filter_off_and_the_run_ends_as_unpatched(fake_nemo, tag, record_property):
    fake_nemo(tag)
    cases.faulty_filter_disable_ends_as_unpatched(tag, fake_worker, record_property)


@pytest.mark.parametrize("tag", NEW)
def test_a_skipped_prev_pass_is_checked_in_the_worker(fake_nemo, tag, record_property):
    fake_nemo(tag)
    cases.skipped_prev_is_checked(tag, fake_worker, record_property)


@pytest.mark.parametrize("tag", ["v0.6.0", "main"])
def test_a_skipped_reference_pass_is_checked_in_the_worker(fake_nemo, tag):
    fake_nemo(tag)
    cases.skipped_reference_is_checked(tag, fake_worker)


def test_v050_has_no_verify_mode(fake_nemo):
    fake_nemo("v0.5.0")
    import nemo_rl.algorithms.grpo  # noqa: F401  (the version is read from the source)

    with pytest.raises(UnsupportedFrameworkError, match="verify mode"):
        grpo_patches.enable("nemo_rl", verify_every=1)


# -- the driver: grpo_train ------------------------------------------------------------------------


def _rollouts(rows: int = 8) -> list[dict]:
    return [make_batch(rows=rows, seed=seed, zero_rows=(1, 2)) for seed in range(STEPS)]


def _grpo(tag: str, options: dict | None, noisy_pass: bool = False, loss: dict | None = None, plugins: tuple = ()):
    """setup + grpo_train (one optimizer step per rollout: the prev pass is skipped); returns
    (policy, logged train metrics per step, final weights, status). ``noisy_pass``: the policy's
    prev-logprob pass gives values the current log-probs do not (as dropout left on would)."""
    from nemo_rl.algorithms import grpo as grpo_module
    from nemo_rl.models.tiny import TinyLM
    from nemo_rl.utils.logger import Logger

    verify_log.reset("nemo_rl")
    for plugin in plugins:
        plugin_manager().register(plugin)
    if options is not None:
        grpo_patches.enable("nemo_rl", **options)
    try:
        config = master_config(tag, loss=loss, policy={"model_factory": TinyLM})
        policy, _, _, _, _, loss_fn, *_ = grpo_module.setup(config, None, None, None)
        if noisy_pass:
            real = policy.get_logprobs

            def noisy(data, timer=None):
                out = real(data)
                noise = 1e-3 * torch.randn(out["logprobs"].shape, generator=torch.Generator().manual_seed(5))
                out["logprobs"] = out["logprobs"] + noise * data["token_mask"]
                return out

            policy.get_logprobs = noisy
        logger = Logger()
        grpo_module.grpo_train(policy, None, _rollouts(), None, None, loss_fn, None, None, logger, None, None, config)
        status = grpo_patches.status()["nemo_rl"]
    finally:
        grpo_patches.disable("nemo_rl")
        for plugin in plugins:
            plugin_manager().unregister(plugin)
    weights = torch.cat([p.detach().reshape(-1) for p in policy.worker.model.parameters()])
    logged = [m for prefix, m in logger.metrics if prefix == "train"]
    return policy, logged, weights, status


@pytest.mark.parametrize("tag", NEW)
def test_grpo_train_verified_logs_its_figures(fake_nemo, tag, record_property):
    fake_nemo(tag)
    _, base_log, base_w, _ = _grpo(tag, None)
    plain, plain_log, plain_w, _ = _grpo(tag, {})
    policy, logged, weights, status = _grpo(tag, {"verify_every": 1})
    assert plain.calls["get_logprobs"] == 0 and policy.calls["get_logprobs"] == STEPS  # the pass, run to compare
    assert torch.equal(weights, plain_w) and rel(weights, base_w) <= 1e-6  # no trace
    for step, (row, plain_row) in enumerate(zip(logged, plain_log)):
        record_property(f"verify_step{step}_old_logprob_max_abs_diff", row[PREFIX + "old_logprob_max_abs_diff"])
        assert row[PREFIX + "old_logprob_max_abs_diff"] <= 1e-5
        assert row[PREFIX + "grad_rel_diff"] <= 1e-5
        assert {k: v for k, v in row.items() if not k.startswith(PREFIX)} == plain_row
    assert status["verify"]["steps_verified"] == STEPS and status["verify"]["failures"] == []
    reference = {"reference_loss_max_abs_diff"} if tag == "v0.6.0" else set()  # grpo_patches skips it on v0.6.0 only
    assert set(status["verify"]["worst"]) == {"old_logprob_max_abs_diff", "grad_rel_diff", *reference}
    if reference:
        assert all(row[PREFIX + "reference_loss_max_abs_diff"] == 0.0 for row in logged)  # KL 0: never read


@pytest.mark.parametrize("tag", ["v0.6.0", "main"])
def test_grpo_train_catches_a_skipped_pass_whose_values_differ(fake_nemo, tag):
    fake_nemo(tag)
    with pytest.raises(ExactnessError) as caught:  # re-raised as itself on the driver
        _grpo(tag, {"verify_every": 1}, noisy_pass=True)
    assert caught.value.optimizations == ("logprob_skip",) and caught.value.step == 0


@pytest.mark.parametrize("tag", ["v0.6.0", "main"])
def test_disable_reaches_the_driver_and_the_run_ends_as_unpatched(fake_nemo, tag):
    fake_nemo(tag)
    _, _, base_w, _ = _grpo(tag, None, noisy_pass=True)
    with pytest.warns(GrpoPatchesWarning, match="logprob_skip switched off by verification in the policy workers"):
        policy, logged, weights, status = _grpo(tag, {"verify_every": 10, "verify_action": "disable"},
                                                noisy_pass=True)
    assert rel(weights, base_w) <= 1e-6
    assert "logprob_skip" in status["switched_off"]
    assert policy.calls["get_logprobs"] == STEPS  # step 0: run to compare; step 1: run, the skip is off
    assert logged[1]["grpo_patches/old_logprob_passes_skipped"] == 0.0
    assert PREFIX + "old_logprob_max_abs_diff" in logged[0] and PREFIX + "old_logprob_max_abs_diff" not in logged[1]


class SkipsTheReferencePass:
    """A faulty ``grpo_skip_reference_pass``: skip, whatever the KL coefficient."""

    @grpo_patches.hookimpl
    def grpo_skip_reference_pass(self, framework, kl_coefficients, kl_metrics_requested):
        return ReferencePassDecision(skip=True, reason="a faulty plugin")


@pytest.mark.parametrize("action", ["raise", "disable"])
def test_a_skipped_reference_pass_that_the_loss_reads_is_caught(fake_nemo, action):
    """v0.6.0 builds no reference model when the pass is skipped: a loss that reads it (KL 0.1) is
    caught on the first verify step, and since nothing can stand in for the model, ``"disable"`` stops too."""
    fake_nemo("v0.6.0")
    with pytest.raises(ExactnessError, match="reference_loss_max_abs_diff") as caught:
        _grpo("v0.6.0", {"verify_every": 1, "verify_action": action}, loss={"reference_policy_kl_penalty": 0.1},
              plugins=(SkipsTheReferencePass(),))
    assert caught.value.optimizations == ("logprob_skip",) and caught.value.step == 0
