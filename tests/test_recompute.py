"""The recompute decision against a brute-force oracle, and where the upstream rules go wrong.

The oracle (:mod:`grpo_patches.adapters.trl.schedule`) tracks the weight version of every micro-step of a
simulated TRL ``GRPOTrainer`` run; a rollout needs old log-probs iff some consumption sees
another version than its generation. Our rule must agree with it on every rollout.
"""

from __future__ import annotations

import itertools

import pytest

from grpo_patches.plugins import hook
from grpo_patches.recompute import cap_consumptions, needs_old_logps, window_steps_left
from grpo_patches.adapters.trl.schedule import (
    Schedule,
    hf_micro_steps_left,
    issue_5770_rule,
    simulate,
    trl_modulo_rule,
    trl_steps_per_epoch,
)

GA_RANGE = range(1, 9)
SPG_RANGE = range(1, 5)
NUM_ITERATIONS_RANGE = range(1, 4)
NUM_EPOCHS = 3


def _epoch_lengths(ga: int, every: int, trl_only: bool) -> list[int]:
    """TRL's epochs are multiples of spg * num_iterations (RepeatSampler); others are any length."""
    lengths = {trl_steps_per_epoch(k, every, 1) for k in (1, 2, 3)}
    if not trl_only:
        lengths |= {ga, 2 * ga, ga + 1, 2 * ga + 1, max(ga - 1, 1)}
    return sorted(lengths)


def _runs(ga: int, spg: int, ni: int, length: int):
    """The fresh run, every resume point (optimizer-step boundaries, epoch ends included) and
    every early stop through ``max_steps``."""
    fresh = simulate(ga, spg, ni, length, NUM_EPOCHS)
    yield fresh
    for r in range(1, fresh.max_steps):
        yield simulate(ga, spg, ni, length, NUM_EPOCHS, resume_at_optimizer_step=r)
        yield simulate(ga, spg, ni, length, max_steps=r)


def _schedules(ga: int, trl_only: bool):
    for spg, ni in itertools.product(SPG_RANGE, NUM_ITERATIONS_RANGE):
        for length in _epoch_lengths(ga, spg * ni, trl_only):
            yield from _runs(ga, spg, ni, length)


def _ours(rollout) -> bool:
    return needs_old_logps(rollout.consumptions_left, rollout.window_steps_left, needed_elsewhere=False)


def _check_hf_loop_invariants(s: Schedule) -> None:
    """The simulator is self-consistent the way the HF loop is (two window formulas agree)."""
    ga, micro = s.gradient_accumulation_steps, s.micro_steps
    assert [m.trl_step for m in micro] == list(range(len(micro)))  # `_step` restarts per train()
    assert [m.index for m in micro] == list(range(micro[0].index, micro[0].index + len(micro)))
    assert micro[-1].version + 1 == s.max_steps and micro[-1].optimizer_steps_after
    for pos, m in enumerate(micro):
        # `do_sync_step` (from `step`) ends exactly the window prefetched by `get_batch_samples`
        assert m.optimizer_steps_after == (m.index_in_window == m.window_length - 1), m
        assert m.window_length in (ga, s.steps_per_epoch % ga or ga)
        if pos:
            assert m.version == micro[pos - 1].version + micro[pos - 1].optimizer_steps_after
        left = window_steps_left(m.index_in_window, m.window_length)
        assert hf_micro_steps_left(m.version, s.max_steps, left, ga, s.steps_per_epoch) == len(micro) - pos
    consumed = [i for r in s.rollouts for i in r.consumed_at]
    assert consumed == [m.index for m in micro]  # rollouts partition the micro-steps


# (1) the property: our rule == the oracle, on every rollout of every schedule


@pytest.mark.parametrize("ga", GA_RANGE)
def test_rule_matches_oracle_on_every_rollout(ga):
    seen = {"needed": 0, "skipped": 0, "short_window": 0, "across_epoch_end": 0, "capped": 0, "resumed": 0}
    for s in _schedules(ga, trl_only=False):
        _check_hf_loop_invariants(s)
        by_index = {m.index: m for m in s.micro_steps}
        for r in s.rollouts:
            where = f"GA={ga} spg={s.steps_per_generation} ni={s.num_iterations} epoch={s.steps_per_epoch} " \
                    f"max_steps={s.max_steps} resume={s.resume_at_optimizer_step} rollout@{r.generated_at}"
            assert r.consumptions_left == len(r.consumed_at), where  # the adapter's formula counts right
            if _ours(r):
                assert r.recompute_needed, f"unnecessary recompute: {where}"
            else:
                assert not r.recompute_needed, f"stale consumption allowed: {where} {r.versions_at_consumption}"
            seen["needed" if r.recompute_needed else "skipped"] += 1
            seen["short_window"] += by_index[r.generated_at].window_length < ga
            seen["across_epoch_end"] += by_index[r.consumed_at[0]].epoch != by_index[r.consumed_at[-1]].epoch
            seen["capped"] += r.consumptions_left < r.generate_every
            seen["resumed"] += s.resume_at_optimizer_step is not None
    # the sweep really exercised each situation (GA=1 has no short windows: every window is 1 long)
    assert all(n > 0 for k, n in seen.items() if not (ga == 1 and k in ("short_window", "skipped"))), seen


# (2) where the upstream rules are wrong


def _rollout_at(s: Schedule, index: int):
    return next(r for r in s.rollouts if r.generated_at == index)


def test_issue_5770_misses_a_recompute_after_an_epoch_end():
    # GA=3, spg=2, 4 micro-steps per epoch: windows [0 1 2][3] | [4 5 6][7]. `_step` does not
    # restart at the epoch end, so the rollout at _step 6 looks window-internal (6//3 == 7//3)
    # although the optimizer steps after micro-step 6 (the first window of epoch 2 ends there).
    s = simulate(3, 2, 1, steps_per_epoch=4, num_epochs=2)
    r = _rollout_at(s, 6)
    assert r.versions_at_consumption == (2, 3) and r.recompute_needed
    assert not issue_5770_rule(3, r)
    assert _ours(r)


def test_issue_5770_misses_a_recompute_after_a_resume():
    # Same run resumed from the checkpoint after optimizer step 1: the new trainer generates
    # at once (`_buffered_inputs is None`) in the 1-micro-step window that ends epoch 1; `_step`
    # restarted at 0, so the formula sees 0//3 == 1//3. The fresh run never generates there.
    s = simulate(3, 2, 1, steps_per_epoch=4, num_epochs=2, resume_at_optimizer_step=1)
    r = _rollout_at(s, 3)
    assert (r.trl_step, r.consumed_at, r.versions_at_consumption) == (0, (3, 4), (1, 2))
    assert r.recompute_needed and not issue_5770_rule(3, r) and _ours(r)
    assert all(x.generated_at != 3 for x in simulate(3, 2, 1, steps_per_epoch=4, num_epochs=2).rollouts)


def test_issue_5770_also_recomputes_needlessly():
    # Epoch 3 starts at _step 8: the window [8 9 10] holds the whole rollout, but 8//3 != 9//3.
    r = _rollout_at(simulate(3, 2, 1, steps_per_epoch=4, num_epochs=3), 8)
    assert issue_5770_rule(3, r) and not r.recompute_needed and not _ours(r)


def test_issue_5770_errors_in_the_sweep_come_from_short_epoch_end_windows():
    """With TRL's own epoch lengths: misses exist after epoch ends and in resumed runs, and only
    when the epoch length does not divide GA (then `_step` drifts against the windows)."""
    misses = {"fresh": 0, "resumed": 0}
    for ga, s in ((ga, s) for ga in GA_RANGE for s in _schedules(ga, trl_only=True)):
        fresh_generations = None
        for r in s.rollouts:
            if r.recompute_needed and not issue_5770_rule(ga, r):
                assert s.steps_per_epoch % ga != 0, (s.steps_per_epoch, r)
                if s.resume_at_optimizer_step is None:
                    misses["fresh"] += 1
                    continue
                if fresh_generations is None:
                    fresh = simulate(ga, s.steps_per_generation, s.num_iterations, s.steps_per_epoch, NUM_EPOCHS)
                    fresh_generations = {x.generated_at for x in fresh.rollouts}
                misses["resumed"] += r.generated_at not in fresh_generations  # caused by the resume
    assert misses["fresh"] > 0 and misses["resumed"] > 0, misses


def test_trl_modulo_rule_recomputes_needlessly_and_we_save_those_passes():
    # GA=3, spg=2, one epoch of 6: windows [0 1 2][3 4 5]; only the rollout at 2 crosses a step.
    s = simulate(3, 2, 1, steps_per_epoch=6)
    assert trl_modulo_rule(3, 2, 1)
    assert [r.recompute_needed for r in s.rollouts] == [False, True, False]
    assert [_ours(r) for r in s.rollouts] == [False, True, False]  # 2 of 3 passes saved
    total = needed = 0
    for ga in GA_RANGE:
        for s in _schedules(ga, trl_only=True):
            if trl_modulo_rule(ga, s.steps_per_generation, s.num_iterations):
                total += len(s.rollouts)
                needed += sum(r.recompute_needed for r in s.rollouts)
    assert 0 < needed < total  # the sweep: the modulo rule pays `total`, we pay `needed`


@pytest.mark.parametrize("ga", GA_RANGE)
def test_trl_modulo_rule_never_misses_with_trl_epoch_lengths(ga):
    # Epochs are multiples of spg*ni and GA % (spg*ni) == 0: generations stay window-aligned,
    # also after epoch ends and resumes. Stock TRL 1.16 is safe, only wasteful.
    for s in _schedules(ga, trl_only=True):
        if not trl_modulo_rule(ga, s.steps_per_generation, s.num_iterations):
            assert not any(r.recompute_needed for r in s.rollouts), s.steps_per_epoch


def test_trl_modulo_rule_misses_when_an_epoch_is_not_a_multiple_of_the_generation_period():
    # GA=2, spg=2 (aligned, so TRL never recomputes), 5 micro-steps per epoch (a sampler other
    # than TRL's RepeatSampler): windows [0 1][2 3][4] | [5 6]...; the rollout generated in the
    # short window [4] is consumed at 5, after the optimizer step.
    s = simulate(2, 2, 1, steps_per_epoch=5, num_epochs=2)
    r = _rollout_at(s, 4)
    assert not trl_modulo_rule(2, 2, 1)
    assert r.window_steps_left == 1 and r.versions_at_consumption == (2, 3)
    assert r.recompute_needed and _ours(r)


# (3) the rule's edges, validation and the hook


@pytest.mark.parametrize(
    ("consumptions", "window", "expected"),
    [(1, 1, False), (2, 1, True), (1, 8, False), (4, 4, False), (5, 4, True), (12, 1, True)],
)
def test_needs_old_logps_edges(consumptions, window, expected):
    assert needs_old_logps(consumptions, window, needed_elsewhere=False) is expected
    assert needs_old_logps(consumptions, window, needed_elsewhere=True) is True


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", None, True])
@pytest.mark.parametrize("name", ["consumptions_left", "window_steps_left"])
def test_needs_old_logps_rejects_bad_counts(name, bad):
    kwargs = {"consumptions_left": 2, "window_steps_left": 2, "needed_elsewhere": False, name: bad}
    with pytest.raises(ValueError, match=name):
        needs_old_logps(**kwargs)


@pytest.mark.parametrize("bad", [0, 1, None, "False"])
def test_needs_old_logps_rejects_non_bool_flag(bad):
    with pytest.raises(ValueError, match="needed_elsewhere"):
        needs_old_logps(2, 2, bad)


def test_helpers():
    assert window_steps_left(0, 3) == 3 and window_steps_left(2, 3) == 1
    assert cap_consumptions(4, 10) == 4 and cap_consumptions(4, 3) == 3
    with pytest.raises(ValueError, match="micro_index_in_window"):
        window_steps_left(3, 3)
    with pytest.raises(ValueError, match="window_length"):
        window_steps_left(0, 0)
    with pytest.raises(ValueError, match="micro_steps_left_in_training"):
        cap_consumptions(2, 0)


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
        ({"steps_per_epoch": 0}, "steps_per_epoch"),
        ({"resume_at_optimizer_step": 4}, "resume_at_optimizer_step"),
        ({"resume_at_optimizer_step": 0}, "resume_at_optimizer_step"),
        ({"max_steps": 0}, "max_steps"),
    ],
)
def test_simulate_rejects_bad_input(kwargs, option):
    args = {"gradient_accumulation_steps": 3, "steps_per_generation": 2, "num_iterations": 1,
            "steps_per_epoch": 4, "num_epochs": 2, **kwargs}
    with pytest.raises(ValueError, match=option):
        simulate(**args)


def test_max_steps_caps_the_last_rollout():
    # GA=1, spg=2, stop after 3 optimizer steps: the rollout at micro-step 2 is consumed once,
    # so the step after micro-step 2 makes no difference and nothing is recomputed.
    r = simulate(1, 2, 1, steps_per_epoch=4, max_steps=3).rollouts[-1]
    assert (r.consumed_at, r.consumptions_left, r.window_steps_left) == ((2,), 1, 1)
    assert not r.recompute_needed and not _ours(r)


def test_through_the_plugin_manager():
    relay = hook()
    assert relay.grpo_recompute_old_logps(
        framework="x", consumptions_left=3, window_steps_left=2, needed_elsewhere=False
    ) is True
    assert relay.grpo_recompute_old_logps(
        framework="x", consumptions_left=2, window_steps_left=2, needed_elsewhere=False
    ) is False
    assert relay.grpo_recompute_old_logps(
        framework="x", consumptions_left=1, window_steps_left=1, needed_elsewhere=True
    ) is True
