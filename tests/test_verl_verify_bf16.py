"""Verify mode on verl in bf16. The engine line holds the gradient comparison to 10 times the
noise floor measured on the same step (verl's own computation repeated, re-batched), not to
the dtype's epsilon; the legacy actor, which has no equivalent repeat, to 10 times the epsilon
(:mod:`grpo_patches.adapters.verl.verify_legacy`).

* correct code passes and logs ``grpo_patches/verify/grad_noise_floor`` next to
  ``grad_rel_diff``;
* a faulty filter plugin is still caught, and the tolerance it failed is the measured floor's
  (below ``10 x eps``, the fallback used without a floor);
* the tiled loss (its head in fp32, so it rounds less than verl's bf16 logits) under verl's
  default mixed precision (fp32 weights, bf16 compute): no alarm on correct code (measured
  0.28-0.30x the tolerance) and a head weight or temperature 5 % off caught (2.6-2.7x); a 2 %
  weight lands at 1.1x (issue 33: the TRL false alarms do not occur here, the floor is verl's own
  re-batched bf16 computation and the tiled loss is 2-3x from it).
"""

from __future__ import annotations

import pytest

from grpo_patches_testing import verl_actor_runs as h

from grpo_patches_testing import verl_engine_runs as engine_runs

if h.VERL is None:
    pytest.skip("verl is not installed (the compat cells install it)", allow_module_level=True)

import torch  # noqa: E402

import grpo_patches  # noqa: E402
from grpo_patches import verify  # noqa: E402
from tests.helpers.faulty_plugins import DropsANonZeroRow, past_the_contract  # noqa: E402
from tests.helpers.verl_fixtures import fresh_verify_records, process_group  # noqa: E402,F401  (autouse)

FILTER = {"zero_advantage_filter": True, "logprob_skip": False, "verify_every": 1}
GRAD, FLOOR = verify.METRIC_PREFIX + "grad_rel_diff", verify.NOISE_METRIC
EPS_FALLBACK = verify.NOISE_FACTOR * 2.0 ** -7  # the tolerance without a measured floor
LEGACY = h.line().startswith("legacy")


@pytest.fixture(autouse=True)
def _verify_mode_is_the_line_under_test():
    """The planted filter faults break the hook's contract: let them past it (tests/helpers/faulty_plugins.py)."""
    with past_the_contract():
        yield


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One verl update in bf16 with ``options``, two mini-batches (optimizer steps)."""
    if LEGACY:
        return lambda options: h.legacy_run(options, n_mini=2, dtype=torch.bfloat16)
    worker = engine_runs.EngineWorker(h.model_dir(str(tmp_path_factory.mktemp("verl_verify_bf16"))), dtype="bf16")
    return lambda options: worker.run(options, n_mini=2)


def test_bf16_verify_is_held_to_the_measured_noise_floor(run, record_property):
    got = run(FILTER)
    diffs = got.metrics[GRAD]
    assert len(diffs) == 2, got.metrics  # one per optimizer step
    if LEGACY:
        assert FLOOR not in got.metrics and max(diffs) <= verify.tolerance("verl", torch.bfloat16) == EPS_FALLBACK
    else:
        floors = got.metrics[FLOOR]
        assert len(floors) == 2 and all(f > 0 for f in floors), floors  # re-batched, the rounding differs
        limits = [verify.tolerance("verl", torch.bfloat16, f) for f in floors]
        assert all(d <= limit < EPS_FALLBACK for d, limit in zip(diffs, limits)), (diffs, floors)
        record_property("bf16_verify_noise_floor", max(floors))
    assert got.status["verify"]["steps_verified"] == 2 and not got.status["verify"]["failures"]
    record_property("bf16_verify_grad_rel_diff", max(diffs))


def test_bf16_faulty_filter_plugin_is_caught(run, record_property):
    plugin = DropsANonZeroRow()
    grpo_patches.plugin_manager().register(plugin)
    try:
        with pytest.raises(grpo_patches.ExactnessError) as err:
            run(FILTER)
    finally:
        grpo_patches.plugin_manager().unregister(plugin)
    assert err.value.step == 0 and "zero_advantage_filter" in err.value.optimizations
    assert err.value.measured > err.value.tolerance
    assert err.value.tolerance == EPS_FALLBACK if LEGACY else err.value.tolerance < EPS_FALLBACK
    record_property("bf16_verify_faulty_grad_rel_diff", err.value.measured)


@pytest.fixture(scope="module")
def tiled_run(tmp_path_factory):
    """One engine update with the tiled loss, fp32 weights and bf16 compute, two mini-batches."""
    if LEGACY:
        pytest.skip("the engine line's tiled loss (the legacy actor's has its own tests)")
    path = engine_runs.model_dir(str(tmp_path_factory.mktemp("verl_tiled_bf16")), fused=True)
    worker = engine_runs.EngineWorker(path, fused=True, remove_padding=True, compute_dtype="bf16")
    return lambda options: worker.run(options, n_mini=2)


TILED = {**FILTER, "tiled_loss": True, "verify_action": "disable"}


@pytest.mark.parametrize("fault", [None, "weight", "temperature"])
def test_bf16_tiled_loss_is_no_false_alarm_and_a_wrong_head_is_caught(tiled_run, fault, record_property):
    from tests.helpers.faulty_plugins import WrongTiledHead

    plugin = {None: None, "weight": WrongTiledHead(weight=1.05), "temperature": WrongTiledHead(temperature=1.05)}[fault]
    if plugin is not None:
        grpo_patches.plugin_manager().register(plugin)
    try:
        got = tiled_run(TILED)
    finally:
        if plugin is not None:
            grpo_patches.plugin_manager().unregister(plugin)
    ratios = [d / verify.tolerance("verl", torch.bfloat16, f) for d, f in zip(got.metrics[GRAD], got.metrics[FLOOR])]
    record_property(f"bf16_tiled_verify_ratio_{fault}", max(ratios))
    if fault is None:
        assert len(ratios) == 2 and max(ratios) < 0.5 and not got.status["verify"]["failures"], ratios
    else:  # disable: switched off at its first step, the rest of the update verl's own
        assert ratios[0] > 1.5 and "tiled_loss" in got.status["verify"]["failures"][0], (ratios, got.status["verify"])
