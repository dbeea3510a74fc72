"""The prev-logprob pass cut to the rows some loss reads (``recompute``), on the stand-in of every tag.

The same cases run on the real worker in the compat cells (``tests/compat_nemo_rl/test_real_prev_rows.py``),
with NeMo-RL's own sharding (dynamic batching, two data-parallel ranks).
"""

from __future__ import annotations

import pytest
import torch

import grpo_patches
from grpo_patches.adapters.nemo_rl import old_logprob_rows
from tests.helpers import nemo_prev_rows_cases as cases
from tests.helpers.nemo_fake import TAGS
from tests.helpers.nemo_worker_harness import batched, fake_worker, make_batch


@pytest.fixture(autouse=True)
def _clean():
    yield
    grpo_patches.disable()


@pytest.mark.parametrize("zero_filter", [True, False])
@pytest.mark.parametrize("global_batches", [1, 2, 4])
@pytest.mark.parametrize("tag", TAGS)
def test_deferred_pass_matches_upstream(fake_nemo, tag, global_batches, zero_filter, record_property):
    fake_nemo(tag)
    got = cases.deferred_matches_upstream(tag, fake_worker, global_batches, zero_filter=zero_filter, lookup=True)
    record_property(f"exact_prev_rows_{global_batches}gb_grad_rel", got["grad_rel"])
    assert got["steps"] == global_batches
    assert got["grad_rel"] <= cases.TOL
    assert got["skipped"] == cases.expected_skipped(global_batches, zero_filter) == got["nan_rows"]


@pytest.mark.parametrize("tag", TAGS)
def test_wrong_rows_treated_as_first_are_caught(fake_nemo, tag, monkeypatch, record_property):
    fake_nemo(tag)
    monkeypatch.setattr(old_logprob_rows, "plan", cases.rows_treated_as_first(8))
    got = cases.deferred_matches_upstream(tag, fake_worker, 2, zero_filter=False, lookup=True)
    record_property("fault_prev_rows_grad_rel", got["grad_rel"])
    assert got["grad_rel"] > 1e3 * cases.TOL


def test_the_plan_at_75_percent_zero_advantage_and_4_global_batches(fake_nemo):
    fake_nemo("main")
    batch = batched(make_batch(rows=16, zero_rows=cases.ZERO_75))
    compute, marks = old_logprob_rows.plan(batch, gbs=4, multiple=1, zero_skip=True)
    assert compute == [r for r in range(4, 16) if r not in cases.ZERO_75] == [7, 10, 14]
    assert marks[:4].tolist() == [old_logprob_rows.FIRST] * 4 and int((marks == old_logprob_rows.ZERO).sum()) == 9
    compute2, marks2 = old_logprob_rows.plan(batch, gbs=4, multiple=2, zero_skip=True)
    assert len(compute2) == 4 and set(compute) < set(compute2) and int((marks2 > 0).sum()) == 12
    assert old_logprob_rows.plan(batch, gbs=4, multiple=1, zero_skip=False)[0] == list(range(4, 16))


@pytest.mark.parametrize("tag", TAGS)
def test_a_skipped_row_read_with_a_non_zero_advantage_raises(fake_nemo, tag):
    fake_nemo(tag)
    from grpo_patches.errors import PlaceholderError
    from grpo_patches.adapters.nemo_rl.placeholders import check_unpatched, substitute

    data = batched(make_batch(rows=4, zero_rows=()))
    data["prev_logprobs"][2] = float("nan")
    data[old_logprob_rows.MARK] = torch.tensor([0.0, 0.0, old_logprob_rows.ZERO, 0.0])
    current = torch.zeros(4, data["input_ids"].shape[1] - 1)
    with pytest.raises(PlaceholderError, match="non-zero advantage"):
        substitute(data, current, patched=True)
    data[old_logprob_rows.MARK] = torch.tensor([0.0, 0.0, old_logprob_rows.FIRST, 0.0])
    assert not torch.isnan(substitute(data, current, patched=True)["prev_logprobs"]).any()
    with pytest.raises(PlaceholderError, match="NeMo-RL's own loss would read it"):
        substitute(data, current, patched=False)
    with pytest.raises(PlaceholderError, match="NeMo-RL's own loss would read it"):
        check_unpatched(data)  # before verify mode's unpatched computation of the global batch
    data["prev_logprobs"][2] = 0.0
    check_unpatched(data)  # the pass ran on every row (the driver's verify step): nothing is read as NaN


@pytest.mark.parametrize("tag", [t for t in TAGS if t != "v0.5.0"])
def test_a_verify_step_compares_the_skipped_rows(fake_nemo, tag, record_property):
    """On a verify step the driver runs the pass on every row: the workers compare the first
    global batch's real values with the current log-probs their loss used, and the run is unchanged."""
    from grpo_patches.errors import ExactnessError
    from tests.helpers.nemo_verify_cases import PREFIX

    fake_nemo(tag)
    base, verified = cases.verify_step(tag, fake_worker)
    figure = max(verified.metrics[PREFIX + "old_logprob_max_abs_diff"])
    record_property("exact_prev_rows_verify_old_logprob_max_abs_diff", figure)
    assert figure <= 1e-5 and max(verified.metrics[PREFIX + "grad_rel_diff"]) <= 1e-5
    assert verified.status["verify"]["failures"] == []
    from tests.helpers.nemo_worker_harness import max_grad_rel
    assert max_grad_rel(verified, base) <= cases.TOL
    with pytest.raises(ExactnessError, match="old_logprob_max_abs_diff"):
        cases.verify_step(tag, fake_worker, first_rows_off=0.01)


def test_each_fallback_says_why(fake_nemo, monkeypatch, tmp_path):
    """Where the cut pass could not be exact the pass runs on every row, and status() says why."""
    from grpo_patches.adapters.nemo_rl.state import LoopCall

    fake_nemo("main")
    grpo_patches.enable("nemo_rl")
    loop = LoopCall(policy=None, loss_fn=None, config={"policy": {}})
    assert "workers are not patched" in old_logprob_rows.why_not(loop)
    for name, value in (("GRPO_PATCHES", "nemo_rl"), ("GRPO_PATCHES_STARTUP_DIR", str(tmp_path)),
                        ("PYTHONPATH", str(tmp_path))):
        monkeypatch.setenv(name, value)
    assert old_logprob_rows.why_not(loop) is None
    packing = LoopCall(policy=None, loss_fn=None, config={"policy": {"sequence_packing": {"enabled": True}}})
    assert "sequence_packing" in old_logprob_rows.why_not(packing)
    megatron = LoopCall(policy=None, loss_fn=None, config={"policy": {"megatron_cfg": {"enabled": True}}})
    assert "Megatron" in old_logprob_rows.why_not(megatron)
    grpo_patches.disable()
    grpo_patches.enable("nemo_rl", recompute=False)
    assert old_logprob_rows.why_not(loop).startswith("recompute=False")
