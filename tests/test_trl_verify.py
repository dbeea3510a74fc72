"""Verify mode in TRL's GRPOTrainer: ``trainer.train()`` with ``verify_every`` on the tiny model.

Every run is the harness's (:mod:`grpo_patches_testing.trl_train`): TRL's real entry point, 8 prompts x 4
generations, GA=3 and steps_per_generation=2 (the recompute decision skips TRL's pass for
every other rollout, the filter defers it for the others), half the prompts with exactly zero
advantages, SGD in fp32 (``bf16=False``).

* Correct code passes and logs its figures: ``grad_rel_diff`` (filter, tiled loss) ~1e-7,
  ``old_logprob_max_abs_diff`` (a skipped pass, the deferred pass) ~0, against 1e-5.
* Verification leaves no trace: the same run without it (AdamW here, so that the optimizer has
  a state) has bitwise the same gradients before each update, optimizer state, random states,
  step counters, weights and metrics (besides the verify figures and wall-clock times).
* The recompute decision: a rollout whose pass TRL's rule runs and the decision skips gets it
  computed (rows through TRL's log-prob method) and compared in each of its micro-steps.
* GMPOTrainer (its own ``_compute_loss``) is verified the same way.
* Faults are caught on the first verify step: a plugin whose ``grpo_filter_zero_advantage``
  drops a row with a non-zero advantage (``"raise"``: ExactnessError; ``"disable"``: the run
  ends with the unpatched run's weights), dropout left on (the skipped old-logprob pass would
  have differed), a placeholder of the deferred pass reaching the loss (PlaceholderError).
"""

from __future__ import annotations

import functools
import math
import warnings

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402

import grpo_patches  # noqa: E402
from grpo_patches import verify_log  # noqa: E402
from grpo_patches.demo import tiny_model  # noqa: E402
from grpo_patches.errors import ExactnessError, GrpoPatchesWarning, PlaceholderError  # noqa: E402
from tests.helpers.faulty_plugins import DropsANonZeroRow, past_the_contract  # noqa: E402
from tests.helpers.trl_runs import gmpo_class, needs_tiled, verify_figures  # noqa: E402
from tests.helpers.trl_trace import TIMES, Tracer, same  # noqa: E402
from tests.helpers.trl_runs import run as filter_test_run  # noqa: E402
from grpo_patches_testing import scratch  # noqa: E402
from grpo_patches_testing.trl_train import train  # noqa: E402

pytestmark = pytest.mark.slow

COMMON = dict(reward_funcs=tiny_model.reward_constant_per_prompt, bf16=False, optim="sgd")
PREFIX = "grpo_patches/verify/"


@pytest.fixture(autouse=True)
def _verify_mode_is_the_line_under_test():
    """The planted filter faults break the hook's contract: let them past it (tests/helpers/faulty_plugins.py)."""
    with past_the_contract():
        yield


def train_verified(options: dict, steps: int, **kwargs):
    """A patched run whose ``status()["verify"]`` holds only its own verification."""
    verify_log.reset("trl")
    return train(True, options, steps=steps, **{**COMMON, **kwargs})


@functools.lru_cache(maxsize=None)
def run(verify_every: int | None, steps: int = 2, reentrant: bool = False, dropout: bool = False, **options):
    """A traced run (:class:`Tracer`, ``result.extra["trace"]``) with AdamW (``dropout``: the
    tiny model with attention dropout, :func:`_dropout_model`)."""
    extra = {} if verify_every is None else {"verify_every": verify_every}
    config = {"gradient_checkpointing_kwargs": {"use_reentrant": True}} if reentrant else {}
    if dropout:
        config["model_path"] = _dropout_model()
    tracer = Tracer()
    result = train_verified({**options, **extra}, steps, optim="adamw_torch", callbacks=[tracer.callback],
                            trainer_hook=tracer.hook, **config)
    result.extra["trace"] = tracer
    return result


verify_rows = verify_figures  # the verify figures of each log row (training rows only)


# -- correct code --------------------------------------------------------------------------------


def test_verify_passes_on_correct_code_and_logs_its_figures():
    got = run(1)  # defaults: recompute decision + zero-advantage filter (with its deferred pass)
    report = got.status["verify"]
    assert report["failures"] == [] and report["steps_verified"] == 2
    # per optimizer step (GA=3): 3 gradient checks; the rollouts whose pass was skipped are
    # compared in each of their micro-steps (4 over the two steps), the deferred one at generation
    assert report["checks"] == 6 + 4 + 1
    rows = verify_rows(got)
    assert len(rows) == 2 and all(set(row) == {"grad_rel_diff", "old_logprob_max_abs_diff"} for row in rows)
    assert all(0 <= row["grad_rel_diff"] <= 1e-6 and row["old_logprob_max_abs_diff"] <= 1e-6 for row in rows)
    assert got.savings["rows_dropped"] > 0 and got.savings["old_logprob_passes_skipped"] == 2
    assert got.savings["old_logprob_rows_skipped"] > 0
    assert "verify" not in got.notes()  # verified: nothing to say per class


def test_verify_leaves_no_trace():
    """Gradients, optimizer state, random states, step counters and weights bitwise, every
    metric besides the verify figures and the clocks exactly. With dropout on, so that every
    extra computation draws random numbers (a tolerance that accepts anything: the patched
    computation is always the one kept)."""
    verified, plain = run(1, dropout=True, verify_tolerance=1e9), run(None, dropout=True)
    assert verify_rows(verified)[0] and not any(verify_rows(plain))  # the verified run did verify
    mine, theirs = verified.extra["trace"], plain.extra["trace"]
    assert len(mine.grads) == len(theirs.grads) == 2 and same(mine.grads, theirs.grads)
    assert len(mine.after) == 2 and mine.after[-1]["optimizer"]  # AdamW: a state to compare
    for a, b in zip(mine.after, theirs.after):
        assert a.keys() == b.keys() and all(same(a[k], b[k]) for k in a), [k for k in a if not same(a[k], b[k])]
    assert [a["global_step"] for a in mine.after] == [1, 2] and [a["micro_step"] for a in mine.after] == [3, 6]
    assert verified.same_weights(plain)
    assert len(verified.log_history) == len(plain.log_history)
    for a, b in zip(verified.log_history, plain.log_history):
        a = {k: v for k, v in a.items() if not k.startswith(PREFIX) and k not in TIMES}
        b = {k: v for k, v in b.items() if k not in TIMES}
        assert a == b
    assert verified.savings == plain.savings


def test_verify_every_n_verifies_the_first_step_and_every_nth():
    """(With reentrant gradient checkpointing, which torch.autograd.grad cannot go through:
    a verify micro-step runs without checkpointing.)"""
    got = run(2, steps=3, reentrant=True)
    assert [bool(row) for row in verify_rows(got)] == [True, False, True]
    assert got.status["verify"]["steps_verified"] == 2 and got.status["verify"]["failures"] == []


def test_a_skipped_pass_is_computed_and_compared():
    """The recompute decision alone (the filter off: TRL's pass is not deferred): each rollout
    the decision skips on a verify step gets TRL's pass over every row, compared in each of
    its micro-steps; the savings are those of the run without verification."""
    counted = dict(reward_funcs=tiny_model.reward_constant_per_prompt, bf16=False, optim="sgd", count_forwards=True)
    options = {"zero_advantage_filter": False}
    verify_log.reset("trl")
    got = train(True, {**options, "verify_every": 1}, steps=2, **counted)
    plain = train(True, options, steps=2, **counted)
    skipped = got.savings["old_logprob_passes_skipped"]
    assert skipped == 2 and got.savings == plain.savings
    rows_per_rollout = 4 * 2  # per_device_train_batch_size x steps_per_generation
    assert got.forwards.no_grad - plain.forwards.no_grad == skipped * rows_per_rollout
    assert got.forwards.with_grad == plain.forwards.with_grad  # nothing else to compare: no filter, no tiles
    assert got.status["verify"]["checks"] == 2 * skipped and got.status["verify"]["failures"] == []
    assert all(set(row) == {"old_logprob_max_abs_diff"} and row["old_logprob_max_abs_diff"] <= 1e-6
               for row in verify_rows(got))
    assert got.same_weights(plain)


def _gmpo():
    return gmpo_class()


def test_gmpo_is_verified_and_a_faulty_filter_is_caught():
    gmpo = _gmpo()
    got = train_verified({"verify_every": 1, "recompute": False}, 1, trainer_class=gmpo)
    assert got.status["verify"]["failures"] == [] and got.status["verify"]["checks"] == 3 + 2  # 3 micro-steps, 2 deferred passes
    (row,) = verify_rows(got)
    assert row["grad_rel_diff"] <= 1e-6 and got.savings["rows_dropped"] > 0
    with pytest.raises(ExactnessError, match=r"trl step 0: zero_advantage_filter changed the result: grad_rel_diff"):
        train_verified({"verify_every": 1, "recompute": False}, 1, trainer_class=gmpo, plugins=[DropsANonZeroRow()])


@needs_tiled
def test_verify_checks_the_tiled_loss():
    got = run(1, steps=1, tiled_loss=True, zero_advantage_filter=False, recompute=False)
    (row,) = verify_rows(got)
    assert set(row) == {"grad_rel_diff"} and row["grad_rel_diff"] <= 1e-5
    assert got.status["verify"]["checks"] == 3 and got.status["verify"]["failures"] == []


# -- faults --------------------------------------------------------------------------------------


def test_a_plugin_that_drops_a_non_zero_row_is_caught_on_the_first_verify_step():
    with pytest.raises(ExactnessError) as caught:
        train_verified({"verify_every": 5}, 2, plugins=[DropsANonZeroRow()])
    err = caught.value
    assert err.framework == "trl" and err.step == 0 and err.quantity == "grad_rel_diff"
    assert "zero_advantage_filter" in err.optimizations and err.measured > 1e-3 > err.tolerance
    message = str(err)  # framework, optimization, step, the difference and the tolerance
    assert message.startswith("grpo_patches verify: trl step 0: zero_advantage_filter")
    assert f"grad_rel_diff = {err.measured:.3e} > tolerance {err.tolerance:.3e}" in message


def test_disable_switches_the_filter_off_and_the_run_ends_as_unpatched():
    plugin = DropsANonZeroRow()
    with pytest.warns(GrpoPatchesWarning, match="zero_advantage_filter switched off by verification at step 0"):
        got = train_verified({"verify_every": 1, "verify_action": "disable"}, 3, plugins=[plugin])
    upstream = filter_test_run(False)  # TRL unpatched, same data and config (3 SGD steps)
    assert plugin.calls >= 1 and got.global_step == upstream.global_step == 3
    assert got.max_weight_diff(upstream) < 1e-6  # a dropped row would move them by ~1e-2
    assert got.status["switched_off"].keys() == {"zero_advantage_filter"}
    for notes in (got.notes(), got.status["notes"]):  # the trainer class's and the run's
        assert notes["zero_advantage_filter"].startswith("off: switched off by verification at step 0: grad_rel_diff")
    assert len(got.status["verify"]["failures"]) == 1
    assert got.metrics("loss") == pytest.approx(upstream.metrics("loss"), rel=1e-5, abs=1e-7)


@functools.lru_cache(maxsize=None)
def _dropout_model() -> str:
    """The tiny model with attention dropout 0.1 (TRL leaves dropout on by default)."""
    model = tiny_model.build_model()
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    path = scratch.directory("tiny_dropout_")
    model.save_pretrained(path)
    tiny_model.build_tokenizer().save_pretrained(path)
    return path


def test_a_skipped_old_logprob_pass_that_would_differ_is_caught():
    """Dropout on: TRL's old-logprob pass and the loss's forward draw different masks, so the
    pass the recompute decision skips would not have equalled the current log-probs."""
    with pytest.raises(ExactnessError) as caught:
        train_verified({"verify_every": 1, "zero_advantage_filter": False}, 1, model_path=_dropout_model())
    err = caught.value
    assert (err.optimizations, err.step, err.quantity) == (("recompute",), 0, "old_logprob_max_abs_diff")
    assert err.measured > 1e-3


def test_disable_switches_the_recompute_decision_off_on_a_skipped_pass_that_would_differ():
    """The same with ``"disable"``: the rollout's micro-steps get TRL's pass, the next rollouts
    TRL's own rule (no further pass skipped), and the run finishes. (Not compared with an
    unpatched run: with dropout on, TRL's pass draws masks the verified run does not draw.)"""
    with pytest.warns(GrpoPatchesWarning, match="recompute switched off by verification at step 0"):
        got = train_verified({"verify_every": 1, "verify_action": "disable", "zero_advantage_filter": False}, 2,
                             model_path=_dropout_model())
    assert got.global_step == 2 and got.status["switched_off"].keys() == {"recompute"}
    assert got.savings["old_logprob_passes_skipped"] == 1  # the first rollout's, before the verdict
    assert got.notes()["recompute"].startswith("off: switched off by verification at step 0")


def test_a_placeholder_reaching_the_loss_is_an_error():
    """A plugin that drops a non-zero row only when the deferred pass asks (``denominator="fixed"``;
    recompute off: TRL runs the pass for every rollout, the filter defers it)
    and keeps it in the loss (``"rows"``, loss_type grpo): the loss would read the placeholder."""
    with pytest.raises(PlaceholderError, match="placeholders"):
        train_verified({"recompute": False}, 1, plugins=[DropsANonZeroRow(only=("fixed",))], loss_type="grpo")


def test_a_placeholder_reaching_the_loss_on_a_verify_step_is_caught():
    """The same fault on a verify step: the placeholder is left NaN, the gradient difference is
    infinite. ``"raise"``: ExactnessError saying so; ``"disable"``: the micro-step uses TRL's
    unpatched loss, the rollout's other micro-batches get TRL's pass, the run ends as unpatched."""
    fault = dict(plugins=[DropsANonZeroRow(only=("fixed",))], loss_type="grpo")
    with pytest.raises(ExactnessError, match="placeholder") as caught:
        train_verified({"recompute": False, "verify_every": 1}, 1, **fault)
    assert caught.value.measured == math.inf and caught.value.optimizations == ("zero_advantage_filter",)
    with pytest.warns(GrpoPatchesWarning, match="zero_advantage_filter switched off by verification at step 0"):
        got = train_verified({"recompute": False, "verify_every": 1, "verify_action": "disable"}, 1, **fault)
    upstream = train(False, steps=1, loss_type="grpo", **COMMON)
    assert got.max_weight_diff(upstream) < 1e-6


# -- the guard itself ------------------------------------------------------------------------------


def test_placeholder_guard_replaces_unread_placeholders_and_refuses_read_ones():
    from grpo_patches.adapters.trl import placeholders

    nan = float("nan")
    old = torch.tensor([[-1.0, -2.0], [nan, nan], [nan, nan], [-3.0, -4.0]])
    inputs = {"old_per_token_logps": old, "advantages": torch.tensor([0.5, 0.0, 0.7, -0.2])}
    with pytest.raises(PlaceholderError, match=r"row\(s\) \[2\]"):
        placeholders.guard(inputs)  # every row read: row 2 has a non-zero advantage
    guarded = placeholders.guard(inputs, read=torch.tensor([0, 1, 3]))  # row 2 left out of the loss
    assert torch.equal(guarded["old_per_token_logps"][1:3], torch.zeros(2, 2))
    assert torch.equal(guarded["old_per_token_logps"][[0, 3]], old[[0, 3]]) and torch.isnan(old[1:3]).all()
    lenient = placeholders.guard(inputs, strict=False)  # zero-advantage rows only; row 2 for the filter
    assert lenient["old_per_token_logps"][1].eq(0).all() and lenient["old_per_token_logps"][2].isnan().all()
    clean = {"old_per_token_logps": old[[0, 3]], "advantages": torch.tensor([1.0, 2.0])}
    assert placeholders.guard(clean) is clean and placeholders.guard({"advantages": old}) == {"advantages": old}
