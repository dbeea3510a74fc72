"""The log-prob skips on two data-parallel ranks (FSDP2 over gloo), patches off vs on.

* reference pass at KL coefficient 0 (both lines): each rank's update without ``ref_log_prob``
  has the gradient of verl's with the real reference log-probs, bitwise, the same steps.
* old-logprob pass on an on-policy update (0.7 legacy actor; engine line): each rank's
  gradient equals verl's with the real old log-probs (legacy bitwise, engine <= 1e-6), and
  ``actor/entropy`` equals what the trainer computes from the skipped pass over the WHOLE
  batch (both ranks' rows: the adapter gathers them), on both ranks.
* tiled lm-head loss (``tiled_loss=True`` on verl's fused forward): each rank's gradient equals
  unpatched verl's fused path (<= 1e-6), the lm-head weight being FSDP2-sharded between forwards.
"""

from __future__ import annotations

import json
import os

import pytest

from grpo_patches_testing import verl_actor_runs as h

from grpo_patches_testing import verl_engine_runs as engine_runs

if h.VERL is None:
    pytest.skip("verl is not installed (the compat cells install it)", allow_module_level=True)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from packaging.version import Version  # noqa: E402

LEGACY = h.line().startswith("legacy")
V = Version(h.VERL)
SKIP = {"zero_advantage_filter": False, "logprob_skip": True}
TOL = 1e-6


def _gathered_entropy(entropy: torch.Tensor, mask: torch.Tensor) -> float:
    """The trainer's ``actor/entropy``: token-mean over every rank's rows."""
    from verl.trainer.ppo.core_algos import agg_loss

    parts = [[torch.zeros_like(t) for _ in range(2)] for t in (entropy, mask)]
    torch.distributed.all_gather(parts[0], entropy.contiguous())
    torch.distributed.all_gather(parts[1], mask.contiguous())
    return agg_loss(loss_mat=torch.cat(parts[0]), loss_mask=torch.cat(parts[1]), loss_agg_mode="token-mean").item()


def _legacy_old_skip(rank: int) -> dict:
    """This rank's actor: verl's old-logprob pass then the update, vs the skipped pass."""
    from verl import DataProto

    from grpo_patches.adapters.verl import placeholders

    def update(options, old):
        h.patches(options)
        run = h.Run()
        model = h.tiny_model(0)
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        actor = h.legacy_actor(model, mini=h.ROWS)
        step = actor._optimizer_step
        actor._optimizer_step = lambda: (run.grads.append(h.grads_of(actor.actor_module.parameters())), step())[1]
        batch = h.rank_rows(h.make_batch(world=2), rank)
        batch.pop("old_log_probs")
        meta = {"temperature": 1.0, "micro_batch_size": 4, "max_token_len": 40, "use_dynamic_bsz": False}
        try:
            if old is None:  # the pass the trainer runs unpatched (every rank its rows)
                out = actor.compute_log_prob(DataProto.from_dict(tensors=dict(batch), meta_info=dict(meta)),
                                             calculate_entropy=True)
                log_probs, entropys = (out["log_probs"], out["entropys"]) if isinstance(out, dict) else out
                run.metrics["trainer/actor/entropy"] = _gathered_entropy(entropys, batch["response_mask"])
                batch["old_log_probs"] = log_probs
                meta = {"temperature": 1.0}
            else:  # what the patched trainer hands over: the placeholder, no marker
                batch["old_log_probs"] = placeholders.like(batch["response_mask"])
                meta = {"temperature": 1.0}
            run.metrics.update(actor.update_policy(DataProto.from_dict(tensors=batch, meta_info=meta)))
        finally:
            h.patches(None)
        return run

    ref, got = update(None, None), update(SKIP, "skipped")
    return {"err": h.max_rel(got, ref), "steps": len(got.grads), "entropy": got.metrics.get("actor/entropy"),
            "trainer_entropy": ref.metrics["trainer/actor/entropy"]}


def _engine_old_skip(rank: int, worker) -> dict:
    """The engine worker's update with old log-probs from its own forward-only pass vs skipped."""
    from tensordict.tensorclass import NonTensorData
    from verl.utils import tensordict_utils as tu

    from grpo_patches.adapters.verl import placeholders

    def td():
        t = engine_runs.engine_batch(rank, 2)
        t.pop("old_log_probs")
        return t

    infer = td()
    tu.assign_non_tensor(infer, micro_batch_size_per_gpu=4, calculate_entropy=True, compute_loss=False,
                         global_token_num=NonTensorData(infer["input_ids"].offsets().diff().tolist()))
    worker.reset_weights()
    out = worker.worker.infer_batch(infer)
    from verl.workers.utils.padding import no_padding_2_padding

    padded = {k: no_padding_2_padding(tu.get(out, k), infer) for k in ("log_probs", "entropy")}
    mask = h.rank_rows(h.make_batch(world=2), rank)["response_mask"]
    trainer_entropy = _gathered_entropy(padded["entropy"], mask)
    ref_td = td()
    ref_td["old_log_probs"] = padded["log_probs"]
    ref = worker.run_td(ref_td, None)
    got_td = td()
    got_td["old_log_probs"] = placeholders.like(mask)
    got = worker.run_td(got_td, SKIP)
    (entropy,) = got.metrics.get("actor/entropy", [None])
    return {"err": h.max_rel(got, ref), "steps": len(got.grads), "entropy": entropy, "trainer_entropy": trainer_entropy}


def _worker(rank: int, port: int, out_dir: str, model_dir: str, fused_dir: str) -> None:
    torch.set_num_threads(1)
    if LEGACY:
        h.init_pg(rank, 2, port)
    else:
        engine_runs.engine_setup(rank, 2, port)
    worker = None if LEGACY else engine_runs.EngineWorker(model_dir)
    kw = dict(agg="token-mean", n_mini=2, use_kl_loss=True, kl_loss_coef=0.0, rank=rank, world=2)
    ref_extra = {"ref_log_prob": h.rank_rows(h.make_batch(world=2), rank)["old_log_probs"] - 0.2}
    if LEGACY:
        ref = h.legacy_run(None, shard=True, batch_extra=ref_extra, **kw)
        got = h.legacy_run(SKIP, shard=True, **kw)
    else:
        ref = worker.run(None, batch_extra=ref_extra, **kw)
        got = worker.run(SKIP, **kw)
    result = {"reference": {"err": h.max_rel(got, ref), "steps": len(got.grads), "ref_steps": len(ref.grads),
                            "kl_logged": sorted(k for k in got.metrics if "kl_loss" in k)}}
    # the tiled loss under FSDP2: the lm-head weight used unsharded inside verl's fused forward
    tiled = {"zero_advantage_filter": False, "logprob_skip": False, "tiled_loss": True}
    kw = dict(agg="seq-mean-token-mean", n_mini=2, rank=rank, world=2)
    if LEGACY:
        fused_ref, fused_got = (h.legacy_run(o, shard=True, fused=True, **kw) for o in (None, tiled))
    else:
        fused_worker = engine_runs.EngineWorker(fused_dir, fused=True, remove_padding=True)
        fused_ref, fused_got = (fused_worker.run(o, **kw) for o in (None, tiled))
    result["tiled"] = {"err": h.max_rel(fused_got, fused_ref), "steps": len(fused_got.grads),
                       "ref_steps": len(fused_ref.grads)}
    if not LEGACY:
        result["old"] = _engine_old_skip(rank, worker)
    elif Version("0.7") <= V:
        result["old"] = _legacy_old_skip(rank)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ws2(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl_ws2_passes")
    model_dir = h.model_dir(str(out)) if not LEGACY else ""
    fused_dir = h.model_dir(str(out), fused=True) if not LEGACY else ""
    mp.spawn(_worker, args=(h.free_port(), str(out), model_dir, fused_dir), nprocs=2, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_reference_skip_on_two_ranks(ws2, record_property):
    for rank in ws2:
        r = rank["reference"]
        assert r["err"] == 0.0 and r["steps"] == r["ref_steps"] == 2 and not r["kl_logged"], r
    record_property("exact_reference_skip_grad_rel_ws2", max(r["reference"]["err"] for r in ws2))


def test_tiled_loss_on_two_ranks(ws2, record_property):
    for rank in ws2:
        t = rank["tiled"]
        assert t["err"] <= TOL and t["steps"] == t["ref_steps"] == 2, t
    record_property("exact_tiled_grad_rel_ws2", max(r["tiled"]["err"] for r in ws2))


@pytest.mark.skipif(LEGACY and V < Version("0.7"), reason="0.6's actor reads old log-probs")
def test_old_logprob_skip_on_two_ranks(ws2, record_property):
    for rank in ws2:
        o = rank["old"]
        assert o["steps"] == 1 and o["err"] <= (0.0 if LEGACY else TOL), o
        assert o["entropy"] == pytest.approx(o["trainer_entropy"], rel=1e-6), o  # the whole batch, not this rank's
    assert ws2[0]["old"]["entropy"] == ws2[1]["old"]["entropy"]
    record_property("exact_old_logprob_skip_grad_rel_ws2", max(r["old"]["err"] for r in ws2))
