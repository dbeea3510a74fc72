"""The prev-logprob pass cut to the rows some loss reads (``recompute``, :mod:`grpo_patches.adapters.nemo_rl.old_logprob_rows`):
the worker-side proofs, shared by the stand-in (main suite) and the real worker (compat cells).

Each case trains the same tiny model on one rollout batch of 16 rows twice: NeMo-RL as it is
(``prev_logprobs`` from a pass over every row, with the weights that generated the batch), and
patched (the driver's :func:`~grpo_patches.adapters.nemo_rl.old_logprob_rows.fill`: the pass on the
other rows only, NaN and a mark in the rows it skips; the workers' loss substitutes them).
The data reaches the worker as ``Policy.train`` hands it over: cut by NeMo-RL's own
``shard_by_batch_size`` (real source: dynamic batching sorts inside each global batch, two
data-parallel ranks take their share of each) — so the first optimizer step's rows are the
rows NeMo-RL really consumes first. Compared: the gradient of every optimizer step (fp32).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

import grpo_patches
from grpo_patches import savings
from tests.helpers.nemo_worker_harness import batched, make_batch, make_loss, max_grad_rel, run_train

TOL = 1e-6
ROWS = 16
LOGPROB_MBS = 2  # the workers' logprob_batch_size
#: 12 of 16 rows at advantage exactly 0 (75 %), spread over every global batch
ZERO_75 = (0, 1, 2, 4, 5, 6, 8, 9, 11, 12, 13, 15)
DYNAMIC_ARGS = {"max_tokens_per_microbatch": 20, "sequence_length_round": 1, "input_key": "input_ids",
                "input_lengths_key": "input_lengths"}


def shard(data: Any, gbs: int, dp: int, rank: int, dynamic: bool) -> Any:
    """Rank ``rank``'s share of ``data`` as ``Policy.train`` cuts it (NeMo-RL's own function)."""
    if dp == 1 and not dynamic and not hasattr(data, "shard_by_batch_size"):
        return data  # the stand-in: one rank, the rows in order (what shard_by_batch_size gives then)
    if dynamic:
        return data.shard_by_batch_size(dp, batch_size=gbs, dynamic_batching_args=dict(DYNAMIC_ARGS))[0][rank]
    return data.shard_by_batch_size(dp, batch_size=gbs)[rank]


def real_prev(tag: str, factory: Callable[..., Any], batch: dict) -> torch.Tensor:
    """The pass NeMo-RL runs on every row, with the weights that generated the batch."""
    with torch.no_grad():
        return factory(tag, ROWS, LOGPROB_MBS).get_logprobs(batched(batch))["logprobs"]


def patched_batch(tag: str, factory: Callable[..., Any], batch: dict, gbs: int, dp: int,
                  full: torch.Tensor | None = None) -> tuple[Any, int]:
    """The driver's deferred pass on ``batch`` (options already enabled): ``(data, rows skipped)``.

    :param full: the pass over every row; a sub-batch's pass is then its rows (the stand-in's
        pass needs whole micro-batches), else the real worker's pass runs on the sub-batch."""
    from grpo_patches.adapters.nemo_rl import old_logprob_rows

    data = batched({k: v for k, v in batch.items() if k != "prev_logprobs"})
    data["prev_logprobs"] = torch.zeros_like(batch["generation_logprobs"])
    worker = factory(tag, ROWS, LOGPROB_MBS)

    def logprobs(sub: Any) -> torch.Tensor:
        if full is not None:
            ids = sub["input_ids"]
            match = [int(torch.nonzero((batch["input_ids"] == row).all(dim=1))[0]) for row in ids]
            return full[match]
        with torch.no_grad():
            return worker.get_logprobs(sub)["logprobs"]

    multiple = dp * LOGPROB_MBS  # what NeMo-RL's pass takes without dynamic batching (old_logprob_rows.pass_multiple)
    skipped = old_logprob_rows.fill(data, gbs, multiple, old_logprob_rows.zero_rows_skippable(make_loss(tag)), logprobs)
    return data, skipped


def deferred_matches_upstream(tag: str, factory: Callable[..., Any], global_batches: int, *, dynamic: bool = False,
                              zero_filter: bool = True, dp: int = 1, rank: int = 0, lookup: bool = False,
                              zero_rows: tuple = ZERO_75) -> dict:
    """One case: ``{"grad_rel", "skipped", "steps", "computed"}`` (asserts nothing itself)."""
    gbs = ROWS // global_batches
    batch = make_batch(rows=ROWS, zero_rows=zero_rows)
    full = real_prev(tag, factory, batch)
    base_data = batched(dict(batch, prev_logprobs=full))
    make = lambda: factory(tag, gbs, 2, dynamic=dynamic, **({"dp": dp} if dp > 1 else {}))  # noqa: E731
    base = run_train(tag, shard(base_data, gbs, dp, rank, dynamic), make_loss(tag), make)
    savings.reset("nemo_rl")
    grpo_patches.enable("nemo_rl", zero_advantage_filter=zero_filter)
    try:
        data, skipped = patched_batch(tag, factory, batch, gbs, dp, full if lookup else None)
        patched = run_train(tag, shard(data, gbs, dp, rank, dynamic), make_loss(tag), make)
    finally:
        grpo_patches.disable("nemo_rl")
    nan_rows = int(torch.isnan(data["prev_logprobs"]).any(dim=1).sum())
    return {"grad_rel": max_grad_rel(patched, base), "skipped": skipped, "nan_rows": nan_rows,
            "steps": len(patched.step_grads), "computed": ROWS - skipped}


def expected_skipped(global_batches: int, zero_filter: bool, dp: int = 1, zero_rows: tuple = ZERO_75) -> int:
    """Rows a correct deferral skips: the first global batch, and (filter on) the later zero rows,
    less those computed anyway to give the pass whole micro-batches on every data-parallel rank."""
    gbs = ROWS // global_batches
    later_zero = sum(1 for r in zero_rows if r >= gbs) if zero_filter else 0
    computed = ROWS - gbs - later_zero
    multiple = dp * LOGPROB_MBS
    if computed % multiple:
        computed += multiple - computed % multiple
    return ROWS - computed


def rows_treated_as_first(gbs: int) -> Callable[..., Any]:
    """A planted fault: the marks of :func:`old_logprob_rows.plan` shifted by one global batch (the
    second global batch's rows treated as the first's)."""
    from grpo_patches.adapters.nemo_rl import old_logprob_rows

    original = old_logprob_rows.plan

    def faulty(data: Any, gbs_: int, multiple: int, zero_skip: bool) -> tuple[list[int], Any]:
        compute, marks = original(data, gbs_, multiple, zero_skip)
        marks = marks.roll(gbs)
        return [r for r in range(marks.shape[0]) if marks[r] == 0], marks

    return faulty


def verify_step(tag: str, factory: Callable[..., Any], first_rows_off: float = 0.0) -> tuple[Any, Any]:
    """A verify step of a deferred batch, as the driver sends it (:func:`old_logprob_rows.run`): the
    pass over every row, the marks, :data:`VERIFY_PREV` on the loss. ``first_rows_off`` moves the
    first global batch's real values (a skipped pass that would not have equalled the current
    log-probs). Returns ``(unpatched run, verified run)``; 2 global batches of 8 rows."""
    from grpo_patches.adapters.nemo_rl import old_logprob_rows
    from grpo_patches.adapters.nemo_rl.state import VERIFY_PREV
    from tests.helpers import nemo_verify_cases

    batch = make_batch(rows=ROWS, zero_rows=ZERO_75)
    full = real_prev(tag, factory, batch)
    base = nemo_verify_cases.train(tag, factory, dict(batch, prev_logprobs=full), None, gbs=8, mbs=2)
    sent = full.clone()
    sent[:8] += first_rows_off * batch["token_mask"][:8]
    _, marks = old_logprob_rows.plan(batched(batch), 8, LOGPROB_MBS, zero_skip=True)
    loss = make_loss(tag)
    setattr(loss, VERIFY_PREV, {"force_on_policy_ratio": loss.__dict__.get("force_on_policy_ratio")})
    verified = nemo_verify_cases.train(tag, factory, dict(batch, prev_logprobs=sent, **{old_logprob_rows.MARK: marks}),
                                       {"zero_advantage_filter": True, "verify_every": 1}, gbs=8, mbs=2, loss_fn=loss)
    return base, verified
