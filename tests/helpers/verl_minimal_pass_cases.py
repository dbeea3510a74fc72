"""The minimal old-logprob pass's cases that verl's v0 trainer (``tests/test_verl_minimal_pass.py``)
and its V1 twin (``tests/test_verl_minimal_pass_v1.py``) share: each takes the module's ``run``
(options, then the keywords of :func:`grpo_patches_testing.verl_minimal_pass.run`), so that one
body, planted faults included, serves both trainers."""

from __future__ import annotations

from typing import Callable

import pytest

from grpo_patches_testing import verl_actor_runs as h

FILTER = {"zero_advantage_filter": True}
NO_FILTER = {"zero_advantage_filter": False}
TOL = 1e-6  # max relative gradient difference, fp32
SKIPPED = "grpo_patches/old_logprob_rows_skipped"

Run = Callable[..., h.Run]


def skipped(run: h.Run) -> float:
    """The rows the patched pass skipped, as the trainer's metric says (0 when it logs none)."""
    return run.metrics.get(SKIPPED, 0.0)


def only_the_first_mini_batch_is_skipped_without_the_filter(run: Run, n_mini: int) -> None:
    ref, got = run(None, n_mini=n_mini), run(NO_FILTER, n_mini=n_mini)
    assert h.max_rel(got, ref) <= TOL
    assert skipped(got) == h.ROWS // n_mini and got.forwards == h.ROWS - h.ROWS // n_mini


def the_wrong_first_mini_batch_stops_the_run(monkeypatch: pytest.MonkeyPatch, run: Run) -> None:
    """Plant a fault: the LAST mini-batch taken as the first one. The worker refuses the rows."""
    import torch

    from grpo_patches.adapters.verl import needed_rows as plan
    from grpo_patches.adapters.verl.placeholders import PlaceholderError

    def last_mini_batch(trainer, rows):
        first = torch.zeros(rows, dtype=torch.bool)
        first[-rows // 4:] = True
        return first

    monkeypatch.setattr(plan, "first_mini_batch", last_mini_batch)
    with pytest.raises(PlaceholderError, match="without old log-probs after 3 optimizer step"):
        run(NO_FILTER, n_mini=4)


def a_skipped_row_reaching_an_unpatched_loss_stops_the_run(monkeypatch: pytest.MonkeyPatch, run: Run) -> None:
    """Plant a fault: the workers' row substitution missing (recompute off there): the guard refuses the placeholder."""
    from grpo_patches.adapters.verl import row_substitution as worker
    from grpo_patches.adapters.verl.placeholders import PlaceholderError

    monkeypatch.setattr(worker, "_substituting_loss", lambda fn, *a, **kw: fn(*a, **kw))  # no substitution
    with pytest.raises(PlaceholderError, match="placeholder reached verl's policy loss"):
        run(NO_FILTER, n_mini=2)
