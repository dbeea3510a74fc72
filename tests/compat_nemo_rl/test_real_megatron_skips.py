"""The log-prob skips with NeMo-RL's real Megatron policy worker (v0.6.0, v0.7.0, main), on a CPU.

A real ``Policy`` (built without its ``__init__``, which needs a Ray cluster) drives the real
``MegatronPolicyWorkerImpl`` (:mod:`tests.helpers.nemo_rl_megatron_harness`) through an
in-process worker group: ``Policy.get_logprobs`` / ``Policy.train`` shard the batch as NeMo-RL
does and hand the worker its shard, and the loss travels pickled, as Ray sends it. A small loop
takes each rollout batch through what the tag's ``grpo_train`` does around the pass: v0.7.0+ asks
``opd._skip_prev_logprobs``, puts zeros in ``prev_logprobs`` when told to skip or runs
``Policy.get_logprobs`` otherwise; v0.6.0 always calls ``Policy.get_logprobs`` (the adapter's wrapper
answers zeros without reaching the workers when it skips) and then
``compute_and_apply_seq_logprob_error_masking``. Both put zeros in ``reference_policy_logprobs`` (KL 0:
no reference model) and call ``Policy.train``. Unpatched, the pass runs every step;
patched (the loop run through the adapter's ``grpo_train`` wrapper), the adapter skips it and its
``Policy.train`` wrapper puts the loss on its on-policy path. Two steps:
the gradient before each optimizer step equal (fp32, rel <= 1e-6), the passes saved counted (v0.6.0: the
loss metrics computed from ``prev_logprobs`` equal too, the patched loss's detached current log-probs in the
placeholder's place). Planted faults: the on-policy switch left off (the loss reads the zero placeholder: the
gradients differ), and the switch lost on the way to the loss (v0.7.0+: the placeholder guard raises; v0.6.0:
the patched loss substitutes the placeholder, exact, and fails with that substitution left off).

With two optimizer steps per rollout batch (``recompute``) the adapter defers the pass to
``Policy.train`` and runs it on the rows some loss reads (:mod:`grpo_patches.adapters.nemo_rl.old_logprob_rows`):
the later optimizer step's rows (with a non-zero advantage when the filter drops the others); the
Megatron worker's loss puts the detached current log-probs in the skipped rows. Gradients of both
optimizer steps equal, rows of the pass counted; a planted fault (the second optimizer step's rows
taken for the first's) fails it. Covered on v0.7.x only: v0.6.0 and main run the pass on every row, as
unpatched, with the reason in ``status()`` (tested). ``Policy.prepare_for_lp_inference`` / ``prepare_for_training``
(GPU off- and onloading around the pass) are not run here.
Skips without a NeMo-RL source (v0.7.0) or Megatron-Bridge on the path.

In bf16 (:mod:`tests.helpers.megatron_tier`: the gpu tier, or ``GRPO_PATCHES_MEGATRON_BF16=1`` on a CPU) each
comparison is against the noise floor: twice what re-batching the same rows moves unpatched (6 rows a micro-batch
instead of 4 for one optimizer step per rollout batch, 3 instead of 2 for two), gradient and loss sum; the
planted faults must land above both the floor and 1e-2, and the reference placeholder's gradient (bitwise
in fp32) must be finite and within the floor.
"""

from __future__ import annotations

import importlib
import os
import pickle
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import pytest
import torch

import grpo_patches
from grpo_patches import savings
from grpo_patches.adapters.nemo_rl import loss_call, old_logprob_rows, old_logprobs, policy_train
from grpo_patches.adapters.nemo_rl.state import PREV_IS_CURRENT
from grpo_patches.errors import PlaceholderError
from grpo_patches_testing.nemo_rl_cpu import tag
from grpo_patches_testing.nemo_rl_tags import make_loss, master_config
from tests.helpers import nemo_prev_rows_cases
from tests.helpers import nemo_rl_megatron_harness as harness
from tests.helpers.megatron_tier import BF16, FP32_TOL
from tests.helpers.megatron_tier import tolerance as noise_tolerance
from tests.helpers.nemo_worker_harness import batched, make_batch, rel

harness.setup()  # skips the module without a NeMo-RL source or Megatron-Bridge
TAG = tag()
OLD = TAG == "v0.6.0"  # the prev-logprob pass through Policy.get_logprobs (v0.7.0+: opd._skip_prev_logprobs)
ROWS = 12  # one rollout batch = one optimizer step (train_global_batch_size): provably on-policy
LOGPROB_KEYS = ("input_ids", "input_lengths", "token_mask", "sample_mask")  # grpo_train's logprob_data


class InProcessWorkers:
    """The ``worker_group`` a ``Policy`` talks to, holding one real Megatron worker in this process:
    each call's ``common_kwargs`` are pickled and unpickled (Ray sends them so), and calls are counted."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.rows: dict[str, list[int]] = {"get_logprobs": [], "train": []}

    def run_all_workers_sharded_data(self, method: str, *, data: list, common_kwargs: dict | None = None,
                                     **_axes: Any) -> list:
        sent = pickle.loads(pickle.dumps(common_kwargs or {}))
        self.rows[method].append(sum(int(shard["input_ids"].shape[0]) for shard in data))
        return [getattr(self.worker, method)(data=shard, **sent) for shard in data]

    def get_all_worker_results(self, futures: list) -> list:
        return futures

    def shutdown(self, **_kwargs: Any) -> bool:  # Policy.__del__
        return True


def real_policy(worker: Any) -> Any:
    """NeMo-RL's ``Policy`` (its own ``train`` / ``get_logprobs``) over :class:`InProcessWorkers`."""
    from nemo_rl.models.policy.lm_policy import Policy

    policy = object.__new__(Policy)
    policy.cfg = dict(worker.cfg)
    policy.worker_group = InProcessWorkers(worker)
    policy.sharding_annotations = type("Axes", (), {"get_axis_size": staticmethod(lambda axis: 1)})()
    policy.use_dynamic_batches = policy.use_sequence_packing = False
    policy.flops_tracker = None
    policy.debug_payload_metrics = False  # main's __init__ sets it (payload-size metrics off)
    policy.prepare_for_lp_inference = policy.prepare_for_training = lambda *args, **kwargs: None  # GPU memory only
    return policy


def grpo_steps(policy: Any, loss_fn: Any, master_config: Any, batches: list[dict]) -> list[dict]:
    """What the tag's ``grpo_train`` does with each rollout batch from its prev-logprob pass to
    ``Policy.train``: v0.7.0+ asks ``opd._skip_prev_logprobs`` and puts zeros in ``prev_logprobs`` when told
    to skip; v0.6.0 always calls ``Policy.get_logprobs`` (the adapter answers zeros there when it skips),
    then ``compute_and_apply_seq_logprob_error_masking`` on the result. KL 0: reference zeros (v0.7.0:
    NeMo-RL's own skip; v0.6.0: what the adapter's reference skip answers)."""
    opd = None if OLD else importlib.import_module("nemo_rl.algorithms.opd")
    results = []
    for batch in batches:
        data = batched(batch)
        if opd is not None and opd._skip_prev_logprobs(master_config):
            data["prev_logprobs"] = torch.zeros_like(data["generation_logprobs"])
        else:
            logprob_data = type(data)({key: data[key] for key in LOGPROB_KEYS})
            data["prev_logprobs"] = policy.get_logprobs(logprob_data, timer=None)["logprobs"]
        data["reference_policy_logprobs"] = torch.zeros_like(data["prev_logprobs"])
        if OLD:
            grpo = importlib.import_module("nemo_rl.algorithms.grpo")
            grpo.compute_and_apply_seq_logprob_error_masking(
                train_data=data, rewards=torch.ones(int(data["input_ids"].shape[0])),
                seq_logprob_error_threshold=master_config["grpo"]["seq_logprob_error_threshold"])
        results.append(policy.train(data, loss_fn, timer=None))
    return results


@dataclass
class Run:
    step_grads: list[torch.Tensor]
    results: list[dict]
    logprob_rows: list[int]  # rows of each get_logprobs call the worker ran
    totals: dict[str, Any] = field(default_factory=dict)  # savings, and status()'s notes


@dataclass
class Tolerance:
    grad: float  # relative, per optimizer step
    loss: float  # absolute, NeMo-RL's summed loss of each train call


def _batches() -> list[dict]:
    return [make_batch(rows=ROWS, seed=seed) for seed in (1, 2)]


def _run(patched: bool, gbs: int = ROWS, options: dict | None = None, mbs: int | None = None, **loss: Any) -> Run:
    """The loop over fresh weights: two rollout batches of :data:`ROWS` rows, one optimizer step each
    (``gbs`` = :data:`ROWS`), or one rollout batch of ``ROWS // gbs`` optimizer steps; ``mbs`` (rows a
    micro-batch and a log-prob batch) 4 or 2 unless given."""
    worker = harness.real_worker(gbs=gbs, mbs=mbs or (4 if gbs == ROWS else 2))
    grads = harness.record_grads(worker)
    policy = real_policy(worker)
    config = master_config(TAG, grpo={"num_prompts_per_step": 3, "num_generations_per_prompt": 4}, loss=loss,
                           policy={**worker.cfg, "megatron_cfg": {**worker.cfg["megatron_cfg"], "enabled": True}})
    batches = _batches() if gbs == ROWS else _batches()[:1]
    call = dict(policy=policy, loss_fn=make_loss(TAG, **loss), master_config=config, batches=batches)
    if not patched:
        results = grpo_steps(**call)
        return Run(grads, results, policy.worker_group.rows["get_logprobs"])
    savings.reset("nemo_rl")
    grpo_patches.enable("nemo_rl", **(options or {"zero_advantage_filter": False}))
    try:
        results = old_logprobs.grpo_train(grpo_steps, None, (), call)  # the adapter's loop context
        totals = dict(savings.totals("nemo_rl"))
        notes = dict(grpo_patches.status()["nemo_rl"]["notes"])
    finally:
        grpo_patches.disable("nemo_rl")
    return Run(grads, results, policy.worker_group.rows["get_logprobs"], {**totals, "notes": notes})


@contextmanager
def raised_in_the_worker() -> Iterator[Any]:
    """``pytest.raises(PlaceholderError)`` around a train call that raises inside the worker, which must
    name the worker's ``train`` in its traceback; then megatron-core's rerun state machine (left mid
    forward-backward by the exception: the next ``train`` would run no micro-batch) is dropped, and
    a fresh one made on its next use, as in a restarted worker."""
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine

    try:
        with pytest.raises(PlaceholderError) as raised:
            yield raised
        worker_file = harness.WORKER_MODULE.rsplit(".", 1)[1] + ".py"
        assert any(entry.path.name == worker_file for entry in raised.traceback)
    finally:
        destroy_rerun_state_machine()


@pytest.fixture(scope="module")
def unpatched() -> Run:
    grpo_patches.disable("nemo_rl")
    return _run(patched=False)


def _max_rel(a: Run, b: Run) -> float:
    assert len(a.step_grads) == len(b.step_grads) == 2 and all(g.norm() > 0 for g in b.step_grads)
    return max(rel(x, y) for x, y in zip(a.step_grads, b.step_grads))


def _noise_floor(base: Run, gbs: int, mbs: int) -> Tolerance:
    """fp32: 1e-6. bf16: twice what re-batching ``base``'s rows (``mbs`` a micro-batch) moves, unpatched."""
    if not BF16:
        return Tolerance(FP32_TOL, 1e-6)
    rebatched = _run(patched=False, gbs=gbs, mbs=mbs)
    loss = max(abs(sum(a["all_mb_metrics"]["loss"]) - sum(b["all_mb_metrics"]["loss"]))
               for a, b in zip(rebatched.results, base.results))
    return Tolerance(noise_tolerance(_max_rel(rebatched, base)), max(1e-6, 2 * loss))


@pytest.fixture(scope="module")
def tolerance(unpatched) -> Tolerance:
    return _noise_floor(unpatched, gbs=ROWS, mbs=6)


def test_prev_skip_gradients_equal_with_the_passes_saved(unpatched, tolerance, record_property):
    patched = _run(patched=True)
    error = _max_rel(patched, unpatched)
    record_property("exact_megatron_prev_skip_grad_rel", error)
    record_property("saved_megatron_prev_skip_logprob_passes", len(unpatched.logprob_rows) - len(patched.logprob_rows))
    record_property("megatron_prev_skip_tolerance_grad_rel", tolerance.grad)  # 1e-6, or bf16's noise floor
    assert error <= tolerance.grad, (error, tolerance)
    assert unpatched.logprob_rows == [ROWS, ROWS] and patched.logprob_rows == []
    assert patched.totals["old_logprob_passes_skipped"] == 2 and patched.totals["old_logprob_rows_skipped"] == 2 * ROWS
    for base, result in zip(unpatched.results, patched.results):
        assert result["all_mb_metrics"]["grpo_patches/old_logprob_passes_skipped"] == [1.0]
        assert sum(result["all_mb_metrics"]["loss"]) == pytest.approx(sum(base["all_mb_metrics"]["loss"]),
                                                                     abs=tolerance.loss)
        if OLD and not BF16:  # v0.6.0's loss computes these from prev log-probs: the patched loss's are the pass's
            read = [key for key in policy_train.PREV_METRICS if key in base["all_mb_metrics"]]
            assert "token_mult_prob_error" in read
            for key in read:
                assert result["all_mb_metrics"][key] == pytest.approx(base["all_mb_metrics"][key], rel=1e-5, abs=1e-6)


def test_reference_placeholder_is_not_read_at_kl_zero(unpatched, tolerance):
    """At KL 0 NeMo-RL v0.7.0 skips the reference pass itself (no reference model) and sends zeros:
    NaN in their place leaves the Megatron worker's gradients bitwise unchanged (nothing reads them);
    bf16: finite and within the noise floor."""
    worker = harness.real_worker(gbs=ROWS, mbs=4)
    grads = harness.record_grads(worker)
    batch = dict(_batches()[0])
    with torch.no_grad():
        batch["prev_logprobs"] = worker.get_logprobs(data=batched(batch))["logprobs"]
    batch["reference_policy_logprobs"] = torch.full_like(batch["prev_logprobs"], float("nan"))
    worker.train(batched(batch), make_loss(TAG))
    assert len(grads) == 1
    if BF16:
        assert bool(torch.isfinite(grads[0]).all()) and rel(grads[0], unpatched.step_grads[0]) <= tolerance.grad
    else:
        assert torch.equal(grads[0], unpatched.step_grads[0])


def test_planted_fault_on_policy_switch_left_off(unpatched, tolerance, monkeypatch, record_property):
    monkeypatch.setattr(policy_train, "_flag", lambda loss_fn: {})  # the loss reads the zero placeholder
    faulty = _run(patched=True)
    error = _max_rel(faulty, unpatched)
    record_property("fault_megatron_prev_skip_switch_off_grad_rel", error)
    assert error > max(1e-2, tolerance.grad), (error, tolerance)


def test_placeholder_guard_fires_in_the_megatron_worker(unpatched, tolerance, monkeypatch, record_property):
    """The switch lost on the way to the loss (the step still marked as skipped): the loss's read of
    the zero placeholder raises instead of training on it. v0.6.0's patched loss reads ``prev_logprobs``
    whatever the switch (importance weights, metrics) and puts the detached current log-probs in the
    placeholder's place: the gradient stays exact, and with that substitution left off (planted) it does not."""

    def marked_only(loss_fn: Any) -> dict:
        saved = {PREV_IS_CURRENT: loss_fn.__dict__.get(PREV_IS_CURRENT, policy_train._ABSENT)}
        setattr(loss_fn, PREV_IS_CURRENT, True)
        return saved

    monkeypatch.setattr(policy_train, "_flag", marked_only)
    if OLD:
        assert _max_rel(_run(patched=True), unpatched) <= tolerance.grad
        monkeypatch.setattr(loss_call, "_with_prev", lambda data, current: data)  # the loss reads the placeholder
        error = _max_rel(_run(patched=True), unpatched)
        record_property("fault_megatron_prev_skip_substitution_off_grad_rel", error)
        assert error > max(1e-2, tolerance.grad), (error, tolerance)
        return
    with raised_in_the_worker() as raised:
        _run(patched=True)
    assert raised.match("zero placeholder")


@pytest.fixture(scope="module")
def unpatched_two_steps() -> Run:
    """One rollout batch, two optimizer steps (``train_global_batch_size`` = half the batch)."""
    grpo_patches.disable("nemo_rl")
    return _run(patched=False, gbs=ROWS // 2)


@pytest.fixture(scope="module")
def tolerance_two_steps(unpatched_two_steps) -> Tolerance:
    return _noise_floor(unpatched_two_steps, gbs=ROWS // 2, mbs=3)


#: the cut pass with the Megatron worker is covered on v0.7.x only (other tags: every row, the reason in ``status()``)
CUT_PASS = TAG == "v0.7.0"


@pytest.fixture()
def workers_reached(monkeypatch, tmp_path):
    """The workers run in this process, patched: what ``grpo-patches run`` tells the driver."""
    monkeypatch.setenv("GRPO_PATCHES", "nemo_rl")
    monkeypatch.setenv("GRPO_PATCHES_STARTUP_DIR", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(tmp_path)])))


@pytest.fixture()
def cut_pass(workers_reached):
    """The workers reached, on a tag whose cut pass with the Megatron worker is covered."""
    if not CUT_PASS:
        pytest.skip(f"not run: the row-subset pass with NeMo-RL {TAG}'s Megatron worker is not covered (the pass "
                    "runs on every row, the reason in status(): test_uncovered_tag_runs_the_pass_on_every_row)")


def test_uncovered_tag_runs_the_pass_on_every_row(unpatched_two_steps, tolerance_two_steps, workers_reached):
    """v0.6.0 and main: two optimizer steps per rollout batch with ``recompute`` on run the prev-logprob pass on
    every row, as NeMo-RL does, and ``status()`` says why (the cut pass is covered on v0.7.x only)."""
    if CUT_PASS:
        pytest.skip("v0.7.x: the cut pass runs (test_deferred_pass_on_the_rows_a_loss_reads)")
    patched = _run(patched=True, gbs=ROWS // 2, options={"zero_advantage_filter": False})
    assert _max_rel(patched, unpatched_two_steps) <= tolerance_two_steps.grad
    assert patched.logprob_rows == unpatched_two_steps.logprob_rows == [ROWS]
    note = patched.totals["notes"]["old_logprob_pass"]
    assert note.startswith("runs:") and "Megatron policy worker (covered on v0.7.x only)" in note, note


@pytest.mark.parametrize("zero_filter", [True, False], ids=["filter", "no-filter"])
def test_deferred_pass_on_the_rows_a_loss_reads(zero_filter, unpatched_two_steps, tolerance_two_steps, cut_pass,
                                                record_property):
    patched = _run(patched=True, gbs=ROWS // 2, options={"zero_advantage_filter": zero_filter})
    error = _max_rel(patched, unpatched_two_steps)
    name = "filter" if zero_filter else "no_filter"
    record_property(f"exact_megatron_prev_rows_{name}_grad_rel", error)
    record_property(f"saved_megatron_prev_rows_{name}_logprob_rows", sum(unpatched_two_steps.logprob_rows)
                    - sum(patched.logprob_rows))
    record_property(f"megatron_prev_rows_{name}_tolerance_grad_rel", tolerance_two_steps.grad)
    assert error <= tolerance_two_steps.grad, (error, tolerance_two_steps)
    # the second optimizer step's 6 rows (rows 8-10 have advantage 0: the filter drops them), in pairs
    # (logprob_batch_size)
    computed = 4 if zero_filter else 6
    assert unpatched_two_steps.logprob_rows == [ROWS] and patched.logprob_rows == [computed]
    assert patched.totals["old_logprob_rows_skipped"] == ROWS - computed
    assert patched.totals["notes"]["old_logprob_pass"].startswith("deferred to Policy.train")
    if zero_filter:
        assert patched.results[0]["all_mb_metrics"]["grpo_patches/rows_dropped"] == [6.0]  # 3 per optimizer step


def test_planted_fault_second_step_rows_taken_for_the_first(unpatched_two_steps, tolerance_two_steps, cut_pass,
                                                            monkeypatch, record_property):
    monkeypatch.setattr(old_logprob_rows, "plan", nemo_prev_rows_cases.rows_treated_as_first(ROWS // 2))
    faulty = _run(patched=True, gbs=ROWS // 2, options={"zero_advantage_filter": False})
    error = _max_rel(faulty, unpatched_two_steps)
    record_property("fault_megatron_prev_rows_grad_rel", error)
    assert error > (max(1e-2, tolerance_two_steps.grad) if BF16 else 1e-3), (error, tolerance_two_steps)


def test_placeholder_guard_fires_for_a_skipped_row_the_loss_reads(cut_pass, monkeypatch):
    """A row of the later optimizer step marked as a zero-advantage row although its advantage is not
    0 (driver and workers disagreeing): the Megatron worker's loss raises instead of reading its NaN."""
    original = old_logprob_rows.plan

    def wrong_zero_row(data: Any, gbs: int, multiple: int, zero_skip: bool) -> tuple[list[int], Any]:
        compute, marks = original(data, gbs, multiple, zero_skip)
        row = next(r for r in compute if r >= gbs and bool((data["advantages"][r] != 0).any()))
        marks[row], marks[0] = old_logprob_rows.ZERO, 0.0  # row 0 computed in its place: the pass keeps its row count
        return sorted([0] + [r for r in compute if r != row]), marks

    monkeypatch.setattr(old_logprob_rows, "plan", wrong_zero_row)
    with raised_in_the_worker() as raised:
        _run(patched=True, gbs=ROWS // 2, options={"zero_advantage_filter": True})
    assert raised.match("non-zero advantage")
