"""Tensor parallel 2 or pipeline parallel 2 (two spawned gloo processes) training NeMo-RL's real Megatron worker.

Both ranks hold the whole batch (12 rows, two global batches of 6, micro-batches of 2; the zero rows of
:data:`tests.helpers.nemo_worker_harness.ZERO_ROWS` leave 3 kept rows per global batch, so the last kept
micro-batch is short). Each rank trains unpatched, patched, and patched with the planted fault (the naive
filter: each global batch's loss renormalised by its kept tokens and rows), each from the same weights, and
runs ``get_logprobs`` unpatched and patched; it reports its gradient shard's differences, the rows and
micro-batches it forwarded (and their token sums: the plan), and the log-probs' equality. In bf16 (the gpu
tier, one GPU a rank, or ``GRPO_PATCHES_MEGATRON_BF16=1`` on a CPU) it also trains unpatched with 6 rows a
micro-batch instead of 2 and reports its tolerance: twice what that re-batching moves (the noise floor).
``GRPO_PATCHES_PLANTED_FAULT=renormalise`` runs the patched run with the fault too (the test must fail).
:func:`run_rank` is the spawned target (:func:`tests.compat_nemo_rl.megatron_dp2.run_ranks` runs both).
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

#: (tensor parallel, pipeline parallel) of each topology
TOPOLOGIES = {"tp2": (2, 1), "pp2": (1, 2)}


@contextmanager
def renormalising_filter(worker_module: Any) -> Iterator[None]:
    """The planted fault: each global batch's loss divided by its kept (non-zero-advantage) tokens and rows."""
    original = worker_module.process_global_batch

    def faulty(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        batch = result["batch"]
        kept = (batch["advantages"] != 0).any(dim=1).float() * batch["sample_mask"]
        result["global_valid_toks"] = (batch["token_mask"][:, 1:] * kept[:, None]).sum()
        result["global_valid_seqs"] = kept.sum()
        return result

    worker_module.process_global_batch = faulty
    try:
        yield
    finally:
        worker_module.process_global_batch = original


def run_rank(rank: int, port: int, topology: str, queue: Any) -> None:
    try:
        queue.put(_train(rank, port, topology))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        queue.put({"rank": rank, "error": repr(exc)})
        raise


def _train(rank: int, port: int, topology: str) -> dict:
    import torch

    import grpo_patches
    from grpo_patches_testing.nemo_rl_cpu import tag
    from grpo_patches_testing.nemo_rl_tags import make_loss
    from tests.helpers import megatron_tier, nemo_rl_megatron_harness as harness
    from tests.helpers.nemo_worker_harness import batched, make_batch, rel

    torch.set_num_threads(1)
    tp, pp = TOPOLOGIES[topology]
    worker_module = harness.setup(rank, 2, port, tp=tp, pp=pp)
    batch = make_batch(rows=12)

    def train(fault: bool = False, mbs: int = 2) -> dict:
        worker = harness.real_worker(gbs=6, mbs=mbs)
        grads = harness.record_grads(worker)
        forwards: list = []  # (rows, token sum) of each micro-batch through the autograd forward

        def count(module: Any, args: tuple, kwargs: dict) -> None:
            if torch.is_grad_enabled():
                ids = kwargs["input_ids"]
                forwards.append((int(ids.shape[0]), int(ids.sum())))

        worker.model.module.register_forward_pre_hook(count, with_kwargs=True)
        with renormalising_filter(worker_module) if fault else nullcontext():
            metrics = worker.train(batched(batch), make_loss(tag()))["all_mb_metrics"]
        return {"grads": grads, "metrics": metrics, "forwards": forwards}

    def logprobs() -> Any:
        return harness.real_worker(gbs=12, mbs=4).get_logprobs(data=batched(batch))["logprobs"]

    base, base_logprobs = train(), logprobs()
    # bf16: re-batching the same rows moves the gradient; each global batch in one micro-batch (at PP 2 on a CPU,
    # 3 rows a micro-batch instead of 2 happens to move nothing: a floor of 0 would measure nothing)
    rebatched = train(mbs=6) if megatron_tier.BF16 else None
    grpo_patches.enable("nemo_rl", zero_advantage_filter=True)
    patched = train(fault=os.environ.get("GRPO_PATCHES_PLANTED_FAULT") == "renormalise")
    faulty = train(fault=True)
    patched_logprobs = logprobs()
    note = grpo_patches.status()["nemo_rl"]["notes"]["zero_advantage_filter"]
    grpo_patches.disable("nemo_rl")

    def max_rel(run: dict) -> float:
        assert len(run["grads"]) == len(base["grads"]) == 2, (len(run["grads"]), len(base["grads"]))
        return max(rel(a, b) for a, b in zip(run["grads"], base["grads"]))

    loss_base = sum(base["metrics"]["loss"])
    noise = {"grad": 0.0, "loss": 0.0}  # fp32: nothing measured
    if rebatched is not None:
        noise = {"grad": max_rel(rebatched), "loss": abs(sum(rebatched["metrics"]["loss"]) - loss_base)}
    return {"rank": rank, "grad_rel": max_rel(patched), "fault_rel": max_rel(faulty),
            "tol": megatron_tier.tolerance(noise["grad"]), "loss_tol": max(1e-6, 2 * noise["loss"]),
            "grad_norm": min(float(g.norm()) for g in base["grads"]),  # a shard with no gradient would compare as 0
            "steps": [len(base["grads"]), len(patched["grads"])], "note": note,
            "rows_base": sum(r for r, _ in base["forwards"]), "rows_patched": sum(r for r, _ in patched["forwards"]),
            "plan": patched["forwards"], "microbatches_base": len(base["forwards"]),
            "loss_base": loss_base, "loss_patched": sum(patched["metrics"]["loss"]),
            "rows_dropped": patched["metrics"]["grpo_patches/rows_dropped"],
            "micro_batches_dropped": patched["metrics"]["grpo_patches/micro_batches_dropped"],
            "logprobs_equal": bool(torch.equal(patched_logprobs, base_logprobs))}
