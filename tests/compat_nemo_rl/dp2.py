"""Two data-parallel ranks (spawned processes, gloo, FSDP2 over DP) training the real worker.

Rank r gets its shard of one global batch of 16 rows from NeMo-RL's own ``shard_by_batch_size``;
the zero-advantage rows are placed so that the ranks keep different numbers of rows. Each rank
trains unpatched then patched and reports its gradient difference and work.
"""

from __future__ import annotations

from typing import Any

ZERO_ROWS = (1, 2, 5, 8, 9, 10, 12, 13)  # 3 in the first half, 5 in the second


def _rank(rank: int, port: int, queue: Any, verify: bool = False) -> None:
    try:
        queue.put(_verify(rank, port) if verify else _train(rank, port))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        queue.put({"rank": rank, "error": repr(exc)})
        raise


def _train(rank: int, port: int) -> dict:
    import torch

    import grpo_patches
    from grpo_patches_testing import nemo_rl_cpu as harness
    from tests.helpers.nemo_worker_harness import batched, make_batch, make_loss, max_grad_rel, run_train

    torch.set_num_threads(1)
    tag = harness.setup()
    harness.init_gloo(rank, 2, port)
    shard = batched(make_batch(rows=16, zero_rows=ZERO_ROWS)).shard_by_batch_size(2, batch_size=16)[rank]
    data = {k: v for k, v in shard.items()}

    def make() -> Any:
        return harness.real_worker(tag, 16, 2, fsdp=True, dp=2)

    base = run_train(tag, data, make_loss(tag), make)
    grpo_patches.enable("nemo_rl", zero_advantage_filter=True)
    patched = run_train(tag, data, make_loss(tag), make)
    dropped = sum(patched.metrics.get("grpo_patches/rows_dropped", [0.0]))
    return {"rank": rank, "grad_rel": max_grad_rel(patched, base), "forwards_base": base.rows_forwarded,
            "forwards_patched": patched.rows_forwarded, "rows_dropped": dropped,
            "zero_rows_here": int((data["advantages"].abs().sum(-1) == 0).sum())}


def _verify(rank: int, port: int) -> dict:
    """Verify mode on both ranks: correct code, then a faulty filter plugin on rank 1 only with
    ``verify_action="disable"`` (both ranks must reach the same verdict and end as unpatched)."""
    import warnings

    import torch

    from grpo_patches_testing import nemo_rl_cpu as harness
    from tests.helpers import nemo_verify_cases as cases
    from tests.helpers.faulty_plugins import DropsANonZeroRow, past_the_contract
    from tests.helpers.nemo_worker_harness import batched, make_batch, max_grad_rel

    torch.set_num_threads(1)
    tag = harness.setup()
    harness.init_gloo(rank, 2, port)
    batch = make_batch(rows=16)
    with torch.no_grad():  # prev log-probs near the model's own: every non-zero-advantage row has a gradient
        logits = harness.tiny_qwen2()(input_ids=batch["input_ids"]).logits.float()
        current = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    batch["prev_logprobs"] = torch.nn.functional.pad(current, (1, 0)) * batch["token_mask"]
    shard = {k: v for k, v in batched(batch).shard_by_batch_size(2, batch_size=16)[rank].items()}

    def make(t: str, gbs: int, mbs: int) -> Any:
        return harness.real_worker(t, gbs, mbs, fsdp=True, dp=2)

    base = cases.train(tag, make, shard, None, gbs=16, mbs=2)
    verified = cases.train(tag, make, shard, {"zero_advantage_filter": True, "verify_every": 1}, gbs=16, mbs=2)
    with warnings.catch_warnings(), past_the_contract():  # the planted fault breaks the filter's contract
        warnings.simplefilter("ignore")
        faulty = cases.train(tag, make, shard, {"zero_advantage_filter": True, "verify_every": 1,
                                                "verify_action": "disable"}, gbs=16, mbs=2,
                             plugins=(DropsANonZeroRow(),) if rank == 1 else ())
    return {"rank": rank, "figure": verified.metrics[cases.PREFIX + "grad_rel_diff"][0],
            "grad_rel": max_grad_rel(verified, base), "faulty_figure": faulty.metrics[cases.PREFIX + "grad_rel_diff"][0],
            "faulty_switched_off": sorted(faulty.status["switched_off"]), "faulty_grad_rel": max_grad_rel(faulty, base)}


def run_ranks(context: Any, port: int, timeout: float = 900, verify: bool = False) -> list[dict]:
    """Run both ranks (``verify``: verify mode's case); their reports, rank 0 first."""
    queue = context.Queue()
    procs = [context.Process(target=_rank, args=(rank, port, queue, verify)) for rank in range(2)]
    for proc in procs:
        proc.start()
    results = sorted((queue.get(timeout=timeout) for _ in procs), key=lambda r: r["rank"])
    for proc in procs:
        proc.join(timeout=60)
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors
    return results
