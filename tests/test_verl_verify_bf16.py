"""Verify mode on verl's engine line in bf16: the gradient comparison is held to 10 times the
noise floor measured on the same step (verl's own computation repeated, re-batched), not to the
dtype's epsilon. (The legacy actor has no re-batched equivalent computation and keeps the
epsilon: :mod:`grpo_patches.adapters.verl.verify_legacy`.)

* correct code passes and logs ``grpo_patches/verify/grad_noise_floor`` next to
  ``grad_rel_diff``;
* a faulty filter plugin is still caught, and the tolerance it failed is the measured floor's
  (below ``10 x eps``, the fallback used without a floor).
"""

from __future__ import annotations

import pytest

from grpo_patches.testing import verl_actor_runs as h

if h.VERL is None:
    pytest.skip("verl is not installed (the compat cells install it)", allow_module_level=True)

import torch  # noqa: E402

import grpo_patches  # noqa: E402
from grpo_patches import verify, verify_log  # noqa: E402
from tests.helpers.faulty_plugins import DropsANonZeroRow  # noqa: E402
from tests.helpers.verl_fixtures import process_group  # noqa: E402,F401  (autouse: one process group per module)

FILTER = {"zero_advantage_filter": True, "logprob_skip": False, "verify_every": 1}
GRAD, FLOOR = verify.METRIC_PREFIX + "grad_rel_diff", verify.NOISE_METRIC
EPS_FALLBACK = verify.NOISE_FACTOR * 2.0 ** -7  # the tolerance without a measured floor
if h.line().startswith("legacy"):
    pytest.skip("the engine line's noise floor (verl 0.8+)", allow_module_level=True)


@pytest.fixture(autouse=True)
def fresh_records():
    verify_log.reset()
    yield
    verify_log.reset()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One verl update in bf16 with ``options``, two mini-batches (optimizer steps)."""
    worker = h.EngineWorker(h.model_dir(str(tmp_path_factory.mktemp("verl_verify_bf16"))), dtype="bf16")
    return lambda options: worker.run(options, n_mini=2)


def test_bf16_verify_is_held_to_the_measured_noise_floor(run, record_property):
    got = run(FILTER)
    diffs, floors = got.metrics[GRAD], got.metrics[FLOOR]
    assert len(diffs) == len(floors) == 2, got.metrics  # one per optimizer step
    assert all(f > 0 for f in floors), floors  # bf16: the repeat's rounding differs
    limits = [verify.tolerance("verl", torch.bfloat16, f) for f in floors]
    assert all(d <= limit < EPS_FALLBACK for d, limit in zip(diffs, limits)), (diffs, floors)
    assert got.status["verify"]["steps_verified"] == 2 and not got.status["verify"]["failures"]
    record_property("bf16_verify_grad_rel_diff", max(diffs))
    record_property("bf16_verify_noise_floor", max(floors))


def test_bf16_faulty_filter_plugin_fails_the_measured_floor(run):
    plugin = DropsANonZeroRow()
    grpo_patches.plugin_manager().register(plugin)
    try:
        with pytest.raises(grpo_patches.ExactnessError) as err:
            run(FILTER)
    finally:
        grpo_patches.plugin_manager().unregister(plugin)
    assert err.value.step == 0 and "zero_advantage_filter" in err.value.optimizations
    assert err.value.measured > err.value.tolerance and err.value.tolerance < EPS_FALLBACK
