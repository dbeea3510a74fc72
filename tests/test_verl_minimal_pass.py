"""The minimal old-logprob pass in verl (option ``recompute``), patches off vs on, one rank.

verl's ``RayPPOTrainer._compute_old_log_prob`` and ``_update_actor`` (the real methods) on the
0.7.x legacy actor or the engine worker (0.8+): the patched trainer runs the pass only on the
rows a loss reads after an optimizer step (not the first mini-batch of the first epoch; not
the zero-advantage rows the filter drops), and every per-step gradient equals verl's with the
whole pass (fp32, rel <= 1e-6), with 1, 2 and 4 mini-batches, 1 and 2 epochs, shuffle on and
off, static and dynamic batch sizes. Planted faults (the wrong mini-batch taken as the first,
the shuffle ignored, a worker without the substitution) stop the run instead of training.
Two data-parallel ranks: ``test_verl_minimal_pass_ws2.py``.
"""

from __future__ import annotations

import contextlib
import io

import pytest

from grpo_patches_testing import verl_actor_runs as h

from grpo_patches_testing import verl_engine_runs as engine_runs
from tests.helpers.verl_fixtures import process_group  # noqa: F401  (autouse: one process group per module)

if h.VERL is None:
    pytest.skip("verl is not installed (the compat cells install it)", allow_module_level=True)

from packaging.version import Version  # noqa: E402

from grpo_patches_testing import verl_minimal_pass as m  # noqa: E402
from tests.helpers import verl_minimal_pass_cases as cases  # noqa: E402
from tests.helpers.verl_minimal_pass_cases import FILTER, NO_FILTER, TOL  # noqa: E402
from tests.helpers.verl_minimal_pass_cases import skipped as _skipped  # noqa: E402

V = Version(h.VERL)
if V < Version("0.7"):
    pytest.skip("the minimal pass needs verl >= 0.7 (RayPPOTrainer._compute_old_log_prob)", allow_module_level=True)
ENGINE = not h.line().startswith("legacy")


def _run(options, **kw):
    worker = engine_runs.shared_worker(dynamic=kw.get("dynamic", False)) if ENGINE else None
    with contextlib.redirect_stdout(io.StringIO()):  # verl's actor prints its settings on every build
        return m.run(options, worker=worker, **kw)


# (mini-batches, epochs, shuffle, dynamic): every count and epoch number, each with shuffle and
# dynamic batch sizes off and on
GRID = [(n, e, s, s) for n in (1, 2, 4) for e in (1, 2) for s in (False, True)]


@pytest.mark.parametrize("n_mini,epochs,shuffle,dynamic", GRID)
def test_gradients_equal_verl_with_the_whole_pass(n_mini, epochs, shuffle, dynamic, record_property):
    kw = dict(n_mini=n_mini, epochs=epochs, shuffle=shuffle, dynamic=dynamic)
    ref, got = _run(None, **kw), _run(FILTER, **kw)
    err = h.max_rel(got, ref)
    record_property("exact_minimal_pass_grad_rel", err)
    assert err <= TOL and len(got.grads) == n_mini * epochs, (err, len(got.grads))
    assert ref.forwards == h.ROWS  # verl's pass: every row
    if n_mini * epochs == 1:  # logprob_skip's whole-batch case: no row pass at all
        assert got.forwards == 0 and _skipped(got) == 0.0
        return
    # rows computed + rows skipped = what verl computed; the filter drops 8 of 16 rows (interleaved)
    assert got.forwards + _skipped(got) == h.ROWS and got.forwards <= 8 + 3, (got.forwards, got.metrics)
    assert got.status["savings"]["old_logprob_rows_skipped"] == _skipped(got) > 0
    assert got.metrics.get("actor/grpo_patches/old_log_probs_substituted",
                           got.metrics.get("grpo_patches/old_log_probs_substituted")) in (1.0, [1.0])


@pytest.mark.parametrize("n_mini", [2, 4])
def test_without_the_filter_only_the_first_mini_batch_is_skipped(n_mini):
    cases.only_the_first_mini_batch_is_skipped_without_the_filter(_run, n_mini)


def test_figures_at_75_percent_zero_advantage_and_4_mini_batches(record_property):
    """The issue's figure: ~3/4 of the mini-batches x 1/4 of the rows (padding to the pass's micro-batches aside)."""
    zero = m.zero_rows(0.75)
    ref, got = _run(None, n_mini=4, zero=zero), _run(FILTER, n_mini=4, zero=zero)
    assert h.max_rel(got, ref) <= TOL
    record_property("old_logprob_rows_computed_vs_upstream", got.forwards / ref.forwards)
    assert got.forwards <= (4 if ENGINE else 3), got.forwards  # 12 rows after the first mini-batch, 3 non-zero


def test_two_epochs_without_the_filter_run_the_whole_pass():
    ref, got = _run(None, n_mini=2, epochs=2), _run(NO_FILTER, n_mini=2, epochs=2)
    assert h.max_rel(got, ref) <= TOL and got.forwards == h.ROWS and _skipped(got) == 0.0
    notes = got.status["by_class"]["verl.trainer.ppo.ray_trainer.RayPPOTrainer"]
    assert "every row is read after an optimizer step" in notes["old_logprob_pass"]


def test_recompute_false_is_verls_own_pass():
    got = _run({"recompute": False, **FILTER}, n_mini=4)
    assert got.forwards == h.ROWS and _skipped(got) == 0.0


# --- planted faults: a wrong plan never trains ----------------------------------------------


def test_the_wrong_first_mini_batch_stops_the_run(monkeypatch):
    cases.the_wrong_first_mini_batch_stops_the_run(monkeypatch, _run)


@pytest.mark.skipif(not ENGINE, reason="0.7's legacy actor splits mini-batches in order (no shuffle)")
def test_a_plan_that_ignores_the_shuffle_stops_the_run(monkeypatch):
    from grpo_patches.adapters.verl import needed_rows as plan
    from grpo_patches.adapters.verl.placeholders import PlaceholderError

    real = plan._engine_first
    monkeypatch.setattr(plan, "_engine_first", lambda actor, per_rank, mini, rank: real(
        {**actor, "shuffle": False}, per_rank, mini, rank))
    with pytest.raises(PlaceholderError, match="without old log-probs"):
        _run(NO_FILTER, n_mini=4, shuffle=True)


def test_a_skipped_row_reaching_an_unpatched_loss_stops_the_run(monkeypatch):
    cases.a_skipped_row_reaching_an_unpatched_loss_stops_the_run(monkeypatch, _run)


def test_the_trainer_runs_the_whole_pass_when_its_workers_do_not_substitute(monkeypatch):
    from grpo_patches.adapters.verl import skip_guarantee

    monkeypatch.setattr(skip_guarantee, "worker_ready", lambda option="logprob_skip": f"{option} is off in the worker")
    got = _run(FILTER, n_mini=4)
    assert got.forwards == h.ROWS and _skipped(got) == 0.0
    notes = got.status["by_class"]["verl.trainer.ppo.ray_trainer.RayPPOTrainer"]
    assert "recompute is off in the worker" in notes["old_logprob_pass"]


def test_a_wrong_filter_prediction_stops_the_run(monkeypatch):
    """Plant a fault: the trainer believes the workers' filter drops zero-advantage rows, the
    workers run without it: such a row reaching the loss after a step is refused."""
    from grpo_patches.adapters.verl import needed_rows as plan
    from grpo_patches.adapters.verl.placeholders import PlaceholderError

    monkeypatch.setattr(plan, "filter_drops_zero_rows", lambda trainer: True)
    with pytest.raises(PlaceholderError, match="without old log-probs after 1 optimizer step"):
        _run(NO_FILTER, n_mini=2)


# --- trainer subclasses: the deferred pass needs fit() to reach _update_actor ----------------


def _subclass(fit_body: str) -> type:
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    namespace: dict = {}
    exec(f"def fit(self):\n    {fit_body}\ndef step(self, batch):\n    return self._update_actor(batch)", namespace)
    return type("RecipeTrainer", (RayPPOTrainer,), {"fit": namespace["fit"], "step": namespace["step"]})


def test_a_fit_that_never_calls_update_actor_runs_the_whole_pass():
    """A recipe's fit() calling the workers' update itself would never run the deferred pass."""
    got = _run(FILTER, n_mini=4, trainer_class=_subclass("self.actor_rollout_wg.update_actor(None)"))
    assert got.forwards == h.ROWS and _skipped(got) == 0.0
    notes = [n for by in got.status["by_class"].values() for n in by.values()]
    assert any("RecipeTrainer.fit never calls _update_actor" in n for n in notes), notes


def test_a_fit_that_reaches_update_actor_through_helpers_keeps_the_minimal_pass():
    """fit -> step -> _update_actor (as verl's SeparateRayPPOTrainer does): deferred as in verl's own fit."""
    got = _run(FILTER, n_mini=4, trainer_class=_subclass("self.step(None)"))
    assert got.forwards < h.ROWS and _skipped(got) > 0
