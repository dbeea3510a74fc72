"""The tiled-loss check both verl Megatron lines run (the engine, :mod:`verl_megatron_harness`; the legacy
actor, :mod:`verl_megatron_legacy_harness`): verl's own unfused Megatron loss against the tiled loss's answer
to verl's fused forward, from the same weights (verl's Triton kernel cannot run on a CPU, so the fused worker's
patched updates never run it)."""

from __future__ import annotations

from typing import Any

import pytest

from grpo_patches_testing import verl_actor_runs as h

#: the tiled loss alone (``True``: any setting it cannot reproduce raises before the first micro-batch)
TILED = {"tiled_loss": True, "zero_advantage_filter": False, "logprob_skip": False}
#: the planted faults the comparison must catch: a temperature 1.25x too large, token weights 1 % off
FAULTS = ("temperature", "token_weights")


def notes(run: h.Run) -> str:
    """Every ``status()`` note of the run, joined."""
    return " ".join(n for by_class in run.status["by_class"].values() for n in by_class.values())


def values(metric: list) -> list:
    """A metric's values: verl 0.6.1's ``append_to_dict`` nests each micro-batch's list, later verls extend."""
    return [v for item in metric for v in (item if isinstance(item, list) else [item])]


def plant(fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One of :data:`FAULTS` in the tiled loss, for the rest of the test."""
    from grpo_patches.adapters.verl import tiled

    if fault == "temperature":
        compute = tiled.compute
        monkeypatch.setattr(tiled, "compute", lambda call, hidden, weight, labels, t: compute(call, hidden, weight,
                                                                                              labels, t * 1.25))
    elif fault == "token_weights":
        weights = tiled.token_weights
        monkeypatch.setattr(tiled, "token_weights", lambda mask, mode, info: weights(mask, mode, info) * 1.01)
    else:
        raise ValueError(f"unknown tiled fault {fault!r} (one of {FAULTS})")


def check(reference: Any, fused: Any, record_property: Any, *, record: str, tolerance: float,
          fault: str | None = None, monkeypatch: pytest.MonkeyPatch | None = None, **run: Any) -> None:
    """``reference`` (verl's unfused loss, unpatched) and ``fused`` (verl's fused forward, :data:`TILED`) updated
    from the same weights with ``run``'s settings.

    ``fault=None``: per-step gradients within ``tolerance``, every training micro-batch through the tiled loss,
    the output layer's ``[tokens, vocab]`` projection never run, verl's ``actor/pg_loss`` kept, the note in
    ``status()``; recorded as ``exact_megatron_{record}_grad_rel``. ``fault`` (:data:`FAULTS`, planted with
    ``monkeypatch``): the same comparison fails, or verl's loss refuses the tiled loss's token weights;
    recorded as ``fault_{record}_{fault}[_grad_rel]``.
    """
    if fault is not None:
        plant(fault, monkeypatch)
    ref = reference.run(None, **run)
    if fault is None:
        got = fused.run(TILED, **run)
        err = h.max_rel(got, ref)  # asserts the same number of optimizer steps
        record_property(f"exact_megatron_{record}_grad_rel", err)
        assert err <= tolerance, (run, err)
        assert ref.projections == ref.forwards > 0 and got.projections == 0, (ref.projections, got.projections)
        assert got.status["savings"]["tiled_loss_micro_batches"] == got.forwards == ref.forwards
        assert sum(values(got.metrics["actor/pg_loss"])) == pytest.approx(sum(values(ref.metrics["actor/pg_loss"])),
                                                                          rel=1e-5, abs=1e-7)
        assert "tile by tile" in notes(got)
        return
    try:
        got = fused.run(TILED, **run)
    except RuntimeError as error:  # verl's loss saw other token weights than the tiled loss used: also caught
        record_property(f"fault_{record}_{fault}", str(error)[:80])
        assert "loss aggregation" in str(error)
        return
    err = h.max_rel(got, ref)
    record_property(f"fault_{record}_{fault}_grad_rel", err)
    assert err > 1e-3, err
