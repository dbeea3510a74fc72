"""The minimal old-logprob pass on verl 0.9's V1 trainer (option ``recompute``), patches off vs on.

The V1 ``PPOTrainer``'s real ``_compute_old_log_prob`` and ``_update_actor`` on the engine
worker, data passed by TransferQueue keys (an in-memory store kept row by row): the patched
trainer runs verl's own pass on the keys of the rows a loss reads after an optimizer step, and
every per-step gradient equals verl's with the whole pass (fp32, rel <= 1e-6) with 2 and 4
mini-batches, shuffle on and off, 2 epochs, dynamic batch sizes. Planted faults stop the run.
"""

from __future__ import annotations

import contextlib
import io

import pytest

from grpo_patches_testing import verl_actor_runs as h
from tests.helpers.verl_fixtures import process_group  # noqa: F401  (autouse: one process group per module)

if h.VERL is None:
    pytest.skip("verl is not installed (the compat cells install it)", allow_module_level=True)

from packaging.version import Version  # noqa: E402

if Version(h.VERL) < Version("0.9"):
    pytest.skip("the V1 (TransferQueue) trainer is verl 0.9's", allow_module_level=True)
pytest.importorskip("transfer_queue")

from grpo_patches_testing import verl_minimal_pass_v1 as v1  # noqa: E402
from tests.helpers import verl_minimal_pass_cases as cases  # noqa: E402
from tests.helpers.verl_minimal_pass_cases import FILTER, NO_FILTER, SKIPPED, TOL  # noqa: E402


def _run(options, monkeypatch, **kw):
    with contextlib.redirect_stdout(io.StringIO()):
        return v1.run(options, monkeypatch=monkeypatch, **kw)


def _runner(monkeypatch):
    """``_run`` as :mod:`tests.helpers.verl_minimal_pass_cases` calls it (options, then keywords)."""
    return lambda options, **kw: _run(options, monkeypatch, **kw)


@pytest.mark.parametrize("n_mini,epochs,shuffle,dynamic", [(2, 1, False, False), (4, 1, False, False),
                                                           (4, 1, True, True), (2, 2, True, False)])
def test_gradients_equal_verl_with_the_whole_pass(monkeypatch, record_property, n_mini, epochs, shuffle, dynamic):
    kw = dict(n_mini=n_mini, epochs=epochs, shuffle=shuffle, dynamic=dynamic)
    ref, got = _run(None, monkeypatch, **kw), _run(FILTER, monkeypatch, **kw)
    err = h.max_rel(got, ref)
    record_property("exact_v1_minimal_pass_grad_rel", err)
    assert err <= TOL and len(got.grads) == len(ref.grads) == n_mini * epochs, (err, len(got.grads))
    assert ref.forwards == h.ROWS  # verl's pass: every row
    # rows computed + rows skipped = what verl computed; the filter drops 8 of 16 rows (interleaved);
    # the pass is topped up only as far as its static micro-batches need
    assert got.forwards + got.metrics[SKIPPED] == h.ROWS and got.forwards <= 8, (got.forwards, got.metrics)
    if (n_mini, shuffle) == (4, False):  # 6 rows needed (kept, after the first mini-batch): 2 micro-batches of 3, not 8 rows
        assert got.forwards == 6, got.forwards
    assert got.status["savings"]["old_logprob_rows_skipped"] == got.metrics[SKIPPED] > 0
    assert got.metrics["actor/grpo_patches/old_log_probs_substituted"] == 1.0
    assert "actor/entropy" not in got.metrics  # the subset's would not be the batch's


@pytest.mark.parametrize("n_mini", [2, 4])
def test_without_the_filter_only_the_first_mini_batch_is_skipped(monkeypatch, n_mini):
    cases.only_the_first_mini_batch_is_skipped_without_the_filter(_runner(monkeypatch), n_mini)


def test_recompute_false_is_verls_own_pass(monkeypatch):
    got = _run({"recompute": False, **FILTER}, monkeypatch, n_mini=4)
    assert got.forwards == h.ROWS and SKIPPED not in got.metrics


def test_the_wrong_first_mini_batch_stops_the_run(monkeypatch):
    cases.the_wrong_first_mini_batch_stops_the_run(monkeypatch, _runner(monkeypatch))


def test_a_skipped_row_reaching_an_unpatched_loss_stops_the_run(monkeypatch):
    cases.a_skipped_row_reaching_an_unpatched_loss_stops_the_run(monkeypatch, _runner(monkeypatch))


def test_a_trainer_that_overrides_the_pass_runs_it_on_every_row(monkeypatch):
    """A subclass with its own ``_compute_old_log_prob`` (the separate-async trainer's version-aware
    pass) calling verl's: the full pass, the reason in ``status()`` for its class."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    class OwnPass(PPOTrainer):
        def _compute_old_log_prob(self, batch, metrics):
            return super()._compute_old_log_prob(batch, metrics)

    got = _run(FILTER, monkeypatch, n_mini=4, base=OwnPass)
    assert got.forwards == h.ROWS and SKIPPED not in got.metrics
    notes = {k: v for c in got.status["by_class"].values() for k, v in c.items()}
    assert "overrides _compute_old_log_prob" in notes["old_logprob_pass"], notes
