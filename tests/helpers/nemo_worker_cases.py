"""The worker-side proofs of the NeMo-RL adapter, shared by the stand-in tests (every CI run) and
the real-source tests (the compat cells): each case takes the tag and a worker factory.

Every case trains the same tiny model twice — NeMo-RL as it is, then patched — and compares
the gradient of every optimizer step (relative difference, fp32), the metrics NeMo-RL returns,
and the work saved (rows through the model, counters).
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import grpo_patches
from grpo_patches import plugin_manager, savings
from grpo_patches.errors import IncompatibleOptionsError
from tests.helpers.nemo_worker_harness import (
    ZERO_ROWS,
    make_batch,
    make_loss,
    max_grad_rel,
    run_train,
    summed,
)

TOL = 1e-6
KEPT = "/kept_rows"
Factory = Callable[..., Any]  # (tag, gbs, mbs, **kw) -> worker


def _both(tag: str, factory: Factory, batch: dict, options: dict, loss: dict | None = None, *, gbs: int, mbs: int,
          micro_batches: list | None = None, worker_kw: dict | None = None):
    """(unpatched run, patched run) of one train call."""
    worker_kw = worker_kw or {}
    make = lambda: factory(tag, gbs, mbs, **worker_kw)  # noqa: E731
    base = run_train(tag, batch, make_loss(tag, **(loss or {})), make, micro_batches)
    savings.reset("nemo_rl")
    grpo_patches.enable("nemo_rl", **options)
    try:
        patched = run_train(tag, batch, make_loss(tag, **(loss or {})), make, micro_batches)
    finally:
        notes = dict(grpo_patches.status()["nemo_rl"]["notes"])
        totals = savings.totals("nemo_rl")
        grpo_patches.disable("nemo_rl")
    patched.notes, patched.totals = notes, totals
    return base, patched


FILTER_CASES = {
    # name: (gbs, mbs, rows, loss overrides, dynamic micro-batches)
    "plain": (12, 4, 12, {}, None),
    "partial-last-microbatch": (10, 2, 10, {}, None),  # 5 kept rows in chunks of 2: a short last one
    "two-optimizer-steps": (6, 2, 12, {}, None),
    "sequence-level": (12, 4, 12, {"token_level_loss": False}, None),
    "dual-clip-and-is": (12, 4, 12, {"ratio_clip_c": 3.0, "use_importance_sampling_correction": True}, None),
    "dynamic-batching": (12, 4, 12, {}, [(0, 3, 9), (3, 7, 8), (7, 12, 9)]),
}


def filter_matches_upstream(tag: str, factory: Factory, case: str, record_property: Callable, label: str = "") -> None:
    gbs, mbs, rows, loss, micro = FILTER_CASES[case]
    batch = make_batch(rows=rows)
    zero = [r for r in ZERO_ROWS if r < rows]
    base, patched = _both(tag, factory, batch, {"zero_advantage_filter": True}, loss, gbs=gbs, mbs=mbs,
                          micro_batches=micro, worker_kw={"dynamic": micro is not None})
    diff = max_grad_rel(patched, base)
    record_property(f"exact_filter_{label}{case}_grad_rel", diff)
    assert diff <= TOL, diff
    assert base.rows_forwarded == rows
    assert patched.rows_forwarded == rows - len(zero)
    before, after = summed(base.metrics), summed(patched.metrics)
    assert after["loss"] == pytest.approx(before["loss"], rel=TOL, abs=1e-9)
    assert after["num_valid_samples"] == pytest.approx(before["num_valid_samples"])  # exact without a forward
    assert "probs_ratio" not in after and "probs_ratio" + KEPT in after
    if tag != "v0.5.0":  # prev-vs-generation metrics need no forward: exact under their names
        assert after["token_mult_prob_error"] == pytest.approx(before["token_mult_prob_error"], rel=TOL)
    assert after["grpo_patches/rows_dropped"] == len(zero)
    assert patched.totals["rows_dropped"] == len(zero)


def kept_rows_metrics_are_kept_row_means(tag: str, factory: Factory) -> None:
    """``<metric>/kept_rows`` equals NeMo-RL's metric of a batch holding only the kept rows."""
    batch = make_batch()
    kept = [r for r in range(12) if r not in ZERO_ROWS]
    only_kept = {k: v[kept] for k, v in batch.items()}
    reference = run_train(tag, only_kept, make_loss(tag), lambda: factory(tag, 6, 3))
    _, patched = _both(tag, factory, batch, {"zero_advantage_filter": True}, gbs=12, mbs=3)
    want, got = summed(reference.metrics), summed(patched.metrics)
    for key in ("probs_ratio", "approx_entropy", "probs_ratio_min", "probs_ratio_max"):
        assert got[key + KEPT] == pytest.approx(want[key], rel=1e-5), key


def dropped_rows_metrics_are_upstream_metrics(tag: str, factory: Factory, record_property: Callable) -> None:
    batch = make_batch()
    base, patched = _both(tag, factory, batch, {"zero_advantage_filter": True, "dropped_rows_metrics": True},
                          gbs=12, mbs=4)
    diff = max_grad_rel(patched, base)
    record_property("exact_filter_dropped_rows_metrics_grad_rel", diff)
    assert diff <= TOL
    before, after = summed(base.metrics), summed(patched.metrics)
    for key, value in before.items():
        assert after[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert patched.rows_forwarded == 12  # the dropped rows ran forward only


def filter_refuses_or_steps_aside(tag: str, factory: Factory) -> None:
    batch = make_batch()
    loss = {"reference_policy_kl_penalty": 0.1}
    with pytest.raises(IncompatibleOptionsError, match=r"loss_fn\.reference_policy_kl_penalty == 0 \(got 0\.1\)"):
        _both(tag, factory, batch, {"zero_advantage_filter": True}, loss, gbs=12, mbs=4)
    base, patched = _both(tag, factory, batch, {"zero_advantage_filter": "auto"}, loss, gbs=12, mbs=4)
    assert max_grad_rel(patched, base) == 0.0 and patched.rows_forwarded == 12
    assert patched.notes["zero_advantage_filter"].startswith("off: the zero-advantage filter needs "
                                                             "loss_fn.reference_policy_kl_penalty == 0")


def filter_steps_aside_for_the_nll_term(tag: str, factory: Factory) -> None:
    """v0.7.0+: ``positive_example_nll_weight`` normalises by each micro-batch's own count, so
    ``True`` refuses it (naming it) and ``"auto"`` leaves every row in."""
    batch = make_batch()
    loss = {"positive_example_nll_weight": 0.5}
    with pytest.raises(IncompatibleOptionsError, match=r"loss_fn\.positive_example_nll_weight == 0 \(got 0\.5\)"):
        _both(tag, factory, batch, {"zero_advantage_filter": True}, loss, gbs=12, mbs=4)
    base, patched = _both(tag, factory, batch, {"zero_advantage_filter": "auto"}, loss, gbs=12, mbs=4)
    assert max_grad_rel(patched, base) == 0.0 and patched.rows_forwarded == 12
    assert "positive_example_nll_weight" in patched.notes["zero_advantage_filter"]


def eval_mode_and_logprobs_see_every_row(tag: str, factory: Factory) -> None:
    from tests.helpers.nemo_worker_harness import batched

    batch = make_batch()
    grpo_patches.enable("nemo_rl", zero_advantage_filter=True)
    try:
        run = run_train(tag, batch, make_loss(tag), lambda: factory(tag, 12, 4), eval_mode=True)
        assert run.rows_forwarded == 12 and run.step_grads == []
        worker = factory(tag, 12, 4)
        logprobs = worker.get_logprobs(batched(batch))["logprobs"]
        assert logprobs.shape == batch["input_ids"].shape
    finally:
        grpo_patches.disable("nemo_rl")


def on_policy_prev_equals_a_real_pass(tag: str, factory: Factory, record_property: Callable) -> None:
    """The flags the driver sets when it skips the prev pass give the step a real pass gives."""
    from grpo_patches.adapters.nemo_rl.state import PREV_IS_CURRENT
    from tests.helpers.nemo_worker_harness import batched

    batch = make_batch()
    with torch.no_grad():
        real = dict(batch, prev_logprobs=factory(tag, 12, 4).get_logprobs(batched(batch))["logprobs"])
    loss = {"use_importance_sampling_correction": False}
    base = run_train(tag, real, make_loss(tag, **loss), lambda: factory(tag, 12, 4))
    skipped = dict(batch, prev_logprobs=torch.zeros_like(batch["prev_logprobs"]))
    on_policy = make_loss(tag, **loss)
    on_policy.force_on_policy_ratio = True
    setattr(on_policy, PREV_IS_CURRENT, True)
    grpo_patches.enable("nemo_rl", zero_advantage_filter=False)
    try:
        patched = run_train(tag, skipped, on_policy, lambda: factory(tag, 12, 4))
    finally:
        grpo_patches.disable("nemo_rl")
    diff = max_grad_rel(patched, base)
    record_property("exact_prev_skip_grad_rel", diff)
    assert diff <= TOL
    before, after = summed(base.metrics), summed(patched.metrics)
    for key in ("loss", "token_mult_prob_error", "gen_kl_error", "sampling_importance_ratio", "approx_entropy"):
        if key in before:
            assert after[key] == pytest.approx(before[key], rel=1e-5, abs=1e-7), key
    if tag in ("v0.5.0", "v0.6.0"):
        assert after["grpo_patches/prev_logprobs_from_current"] > 0


class HookSpy:
    """Counts ``grpo_lm_head_loss`` calls and defers to the built-in tiled loss."""

    def __init__(self) -> None:
        self.calls = 0

    @grpo_patches.hookimpl
    def grpo_lm_head_loss(self, hidden, weight, labels, advantages, mask, options):
        self.calls += 1
        assert hidden.dim() == 3 and hidden.shape[:2] == labels.shape  # never [tokens, vocab] logits
        return None


TILED_CASES = {
    "token-level": ({}, {}),
    "sequence-level": ({"token_level_loss": False}, {}),
    "dual-clip": ({"ratio_clip_c": 3.0}, {}),
    "temperature": ({}, {"temperature": 0.7}),
    "tied-head": ({}, {"tied": True}),
}


def tiled_matches_upstream(tag: str, factory: Factory, case: str, record_property: Callable,
                           with_filter: bool = False) -> None:
    loss, worker_kw = TILED_CASES[case]
    spy = HookSpy()
    plugin_manager().register(spy)
    try:
        base, patched = _both(tag, factory, make_batch(), {"tiled_loss": True, "zero_advantage_filter": with_filter},
                              loss, gbs=12, mbs=4, worker_kw=worker_kw)
    finally:
        plugin_manager().unregister(spy)
    diff = max_grad_rel(patched, base)
    record_property(f"exact_tiled_{case}{'_filtered' if with_filter else ''}_grad_rel", diff)
    assert diff <= TOL, diff
    assert spy.calls == (2 if with_filter else 3)  # one per training micro-batch (6 kept rows / 4, or 12 / 4)
    before, after = summed(base.metrics), summed(patched.metrics)
    if not with_filter:
        for key, value in before.items():
            assert after[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def tiled_refuses_or_steps_aside(tag: str, factory: Factory) -> None:
    loss = {"reference_policy_kl_penalty": 0.1}
    with pytest.raises(IncompatibleOptionsError, match=r"reference_policy_kl_penalty=0\.1 \(the KL term\)"):
        _both(tag, factory, make_batch(), {"tiled_loss": True, "zero_advantage_filter": False}, loss, gbs=12, mbs=4)
    spy = HookSpy()
    plugin_manager().register(spy)
    try:
        base, patched = _both(tag, factory, make_batch(), {"tiled_loss": "auto", "zero_advantage_filter": False},
                              loss, gbs=12, mbs=4)
    finally:
        plugin_manager().unregister(spy)
    assert spy.calls == 0 and max_grad_rel(patched, base) == 0.0
    assert patched.notes["tiled_loss"].startswith(
        "off: the tiled loss does not reproduce NeMo-RL's loss with loss_fn.reference_policy_kl_penalty=0.1")
