"""``pack_kept_rows`` in TRL: the kept rows of an accumulation window dealt into full micro-batches.

Same tiny model, same data, patch off and on: every optimizer step's gradient equal (fp32,
relative L2 <= 1e-6), fewer forward/backward calls (counted beneath the patches), the same
number of micro-steps and optimizer steps. A planted fault (a dealt micro-batch that loses a
kept row) fails the comparison.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from grpo_patches.demo import tiny_model  # noqa: E402
from grpo_patches_testing.trl_train import require_loss_type, train  # noqa: E402

from tests.helpers.trl_gradients import Gradients, rel_l2  # noqa: E402
from tests.helpers.trl_runs import needs_tiled  # noqa: E402


#: GA = steps_per_generation = 4 micro-batches of 4 rows per window; half the prompts saturated.
CONFIG = dict(steps=2, reward_funcs=tiny_model.reward_constant_per_prompt, bf16=False, optim="sgd",
              count_forwards=True, gradient_accumulation_steps=4, steps_per_generation=4, num_prompts=8,
              loss_type="grpo")  # in every TRL (the default, TRL 0.20's bnpo, is not packed)
ONLY_FILTER = dict(recompute=False, logprob_skip=False, tiled_loss=False, zero_advantage_filter=True)


def _run(packed: bool | None, **overrides):
    grads = Gradients()
    options = None if packed is None else dict(ONLY_FILTER, pack_kept_rows=packed)
    result = train(packed is not None, options, callbacks=[grads.callback], **{**CONFIG, **overrides})
    return result, grads.steps


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "cispo"])
def test_packing_gives_the_same_gradient_with_fewer_calls(loss_type):
    require_loss_type(loss_type)
    ref, ref_grads = _run(None, loss_type=loss_type)
    got, got_grads = _run(True, loss_type=loss_type)
    assert ref.global_step == got.global_step == 2 and len(ref_grads) == len(got_grads) == 2
    for step, (a, b) in enumerate(zip(got_grads, ref_grads)):
        assert rel_l2(a, b) <= 1e-6, (step, rel_l2(a, b))
    saved = got.savings
    assert saved["micro_batches_dropped"] > 0
    assert got.notes()["pack_kept_rows"].startswith("on")
    # the skipped micro-steps ran no policy forward: kept rows only, in fewer calls
    assert got.forwards.with_grad == ref.forwards.with_grad - saved["rows_dropped"]
    assert got.forwards.with_grad_calls == ref.forwards.with_grad_calls - saved["micro_batches_dropped"]
    print(f"{loss_type}: calls {ref.forwards.with_grad_calls} -> {got.forwards.with_grad_calls}, rows "
          f"{ref.forwards.with_grad} -> {got.forwards.with_grad}, grad rel "
          f"{max(rel_l2(a, b) for a, b in zip(got_grads, ref_grads)):.1e}")


def test_bnpo_is_not_packed_under_auto_and_refused_under_true():
    from grpo_patches.errors import IncompatibleOptionsError

    got, _ = _run("auto", loss_type="bnpo", steps=1)
    assert got.notes()["pack_kept_rows"].startswith("off") and "bnpo" in got.notes()["pack_kept_rows"]
    assert "micro_batches_dropped" not in got.savings or not got.savings["micro_batches_dropped"]
    with pytest.raises(IncompatibleOptionsError, match="pack_kept_rows"):
        _run(True, loss_type="bnpo", steps=1)


def _kept_row_dealt_into_a_skipped_micro_batch(real):
    """A planted fault: the deal swaps the first kept row with the first zero-advantage row (in a
    micro-batch that gets no forward): every row still dealt once, one kept row never trained."""
    def order(kept, size, micro_batches, calls):
        dealt = real(kept, size, micro_batches, calls)
        useful = {(b, r) for b, rows in enumerate(kept) for r in rows}
        first_kept = next(i for i, pair in enumerate(dealt) if pair in useful)
        dealt[0], dealt[first_kept] = dealt[first_kept], dealt[0]
        return dealt

    return order


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_kept_row_dealt_into_a_skipped_micro_batch_fails_the_comparison(monkeypatch, bf16):
    """The planted fault is far outside both tolerances: 1e-6 in fp32, 4x upstream's re-batching
    noise in bf16 (1.5e-3 on this model: the bf16 test)."""
    from grpo_patches.adapters.trl import packing

    ref, ref_grads = _run(None, loss_type="grpo", bf16=bf16, steps=1)
    monkeypatch.setattr(packing, "_order", _kept_row_dealt_into_a_skipped_micro_batch(packing._order))
    got, got_grads = _run(True, loss_type="grpo", bf16=bf16, steps=1)
    fault = rel_l2(got_grads[0], ref_grads[0])
    print(f"planted fault ({'bf16' if bf16 else 'fp32'}): step-1 gradient rel diff {fault:.1e}")
    assert fault > 2e-2


def test_a_deal_that_loses_a_row_is_an_error_before_any_training(monkeypatch):
    from grpo_patches.adapters.trl import packing
    from grpo_patches.errors import GrpoPatchesError

    real = packing._order

    def loses_one(kept, size, micro_batches, calls):
        dealt = real(kept, size, micro_batches, calls)
        dealt[-1] = dealt[0]
        return dealt

    monkeypatch.setattr(packing, "_order", loses_one)
    with pytest.raises(GrpoPatchesError, match="pack_kept_rows=False"):
        _run(True, loss_type="grpo", steps=1)


def test_windows_cut_by_rollouts_and_iterations_stay_exact():
    """GA=3 over steps_per_generation=2, two iterations: a window spans two buffer passes and
    each segment is dealt on its own; TRL's buffer itself is never changed (the second
    iteration re-reads it)."""
    overrides = dict(gradient_accumulation_steps=3, steps_per_generation=2, num_iterations=2, steps=3)
    ref, ref_grads = _run(None, **overrides)
    got, got_grads = _run(True, **overrides)
    assert len(ref_grads) == len(got_grads) == 3
    assert max(rel_l2(a, b) for a, b in zip(got_grads, ref_grads)) <= 1e-6
    assert got.savings["micro_batches_dropped"] > 0


def test_loss_is_logged_as_before_and_per_micro_batch_means_are_not():
    ref, _ = _run(None, loss_type="grpo")
    got, _ = _run(True, loss_type="grpo")
    assert got.metrics("loss") == pytest.approx(ref.metrics("loss"), rel=1e-5, abs=1e-7)  # on-policy: ~0
    assert ref.metrics("clip_ratio/region_mean") and not got.metrics("clip_ratio/region_mean")
    assert "pack_kept_rows" in got.notes()["metric clip_ratio/region_mean"]
    assert got.metrics("grpo_patches/micro_batches_dropped")


def test_verify_steps_check_the_dealt_micro_batches_and_catch_a_bad_deal(monkeypatch):
    from grpo_patches.adapters.trl import packing
    from grpo_patches.errors import ExactnessError

    from grpo_patches import verify_log

    options = dict(ONLY_FILTER, pack_kept_rows=True, verify_every=1)
    verify_log.reset("trl")  # its counts are the process's: an earlier module's verify steps would add up
    result = train(True, options, **{**CONFIG, "steps": 1})
    assert result.status["verify"]["steps_verified"] == 1 and not result.status["verify"]["failures"]
    assert result.savings["micro_batches_dropped"] > 0
    monkeypatch.setattr(packing, "_order", _kept_row_dealt_into_a_skipped_micro_batch(packing._order))
    with pytest.raises(ExactnessError) as err:
        train(True, options, **{**CONFIG, "steps": 1})
    assert err.value.quantity == "grad_rel_diff" and err.value.measured > 0.5  # TRL's gradient where the skip has 0


def test_one_micro_batch_per_window_changes_nothing():
    got, _ = _run(True, gradient_accumulation_steps=1, steps_per_generation=4, steps=2)
    assert not got.savings.get("micro_batches_dropped") and got.savings["rows_dropped"] > 0


def test_packing_with_every_default_optimization_stays_exact():
    """With recompute and the log-prob skip on too: the deferred old-logprob pass (kept rows only)
    feeds the dealt micro-batches; a placeholder is never read."""
    overrides = dict(gradient_accumulation_steps=3, steps_per_generation=2, steps=3)  # rollouts cross windows
    ref, ref_grads = _run(None, **overrides)
    grads = Gradients()
    got = train(True, {"pack_kept_rows": True}, callbacks=[grads.callback], **{**CONFIG, **overrides})
    assert max(rel_l2(a, b) for a, b in zip(grads.steps, ref_grads)) <= 1e-6
    assert got.savings["micro_batches_dropped"] > 0 and got.savings["old_logprob_rows_skipped"] > 0


def test_bf16_packing_stays_within_upstreams_own_rebatching_noise():
    """bf16 autocast: dealing rows into other micro-batches changes which rows share a matmul,
    so the rounding. Step 1's gradient (same weights, same generations) is judged against
    unpatched TRL re-batched the same way a user could: the same rows of each window in 2
    micro-batches of 8 instead of 4 of 4 (grpo's per-row terms over equal-size micro-batches:
    the same gradient in exact arithmetic). A planted fault (a kept row lost) stays far outside it."""
    bf16 = dict(bf16=True, steps=1, loss_type="grpo")
    ref, ref_grads = _run(None, **bf16)
    _, rebatched = _run(None, **bf16, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                        steps_per_generation=2)
    floor = rel_l2(rebatched[0], ref_grads[0])
    _, got_grads = _run(True, **bf16)
    packed = rel_l2(got_grads[0], ref_grads[0])
    print(f"bf16 step-1 gradient vs unpatched: upstream re-batched {floor:.1e}, packed {packed:.1e}")
    assert 0 < floor and packed <= 4 * floor, (packed, floor)


@needs_tiled
def test_packing_with_the_tiled_loss_stays_exact():
    """The dealt micro-batches' loss tile by tile (TRL 1.16's normalisers), the skipped ones none."""
    overrides = dict(loss_type="dapo")
    ref, ref_grads = _run(None, **overrides)
    grads = Gradients()
    got = train(True, dict(ONLY_FILTER, pack_kept_rows=True, tiled_loss=True), callbacks=[grads.callback],
                **{**CONFIG, **overrides})
    assert max(rel_l2(a, b) for a, b in zip(grads.steps, ref_grads)) <= 1e-5
    assert got.savings["micro_batches_dropped"] > 0 and got.notes()["tiled_loss"].startswith("on")
    assert got.forwards.with_grad_calls == ref.forwards.with_grad_calls - got.savings["micro_batches_dropped"]
