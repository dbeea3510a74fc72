"""The minimal old-logprob pass on verl 0.9's V1 trainer (option ``recompute``), two data-parallel
ranks (FSDP2 over gloo).

Each rank runs the V1 ``PPOTrainer``'s real ``_compute_old_log_prob`` / ``_update_actor`` with a
worker group that hands the update its ``KVBatchMeta.chunk`` (as verl's dispatch does); the
engine worker shuffles each rank's mini-batches with its own seed (``data_loader_seed + rank``),
so the rows each rank consumes first differ. Every per-step gradient equals verl's with the whole
pass (rel <= 1e-6) and the rows skipped are counted (the planted faults: ``test_verl_minimal_pass_v1.py``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os

import pytest

from grpo_patches.testing import verl_actor_runs as h

if h.VERL is None:
    pytest.skip("verl is not installed (the compat cells install it)", allow_module_level=True)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from packaging.version import Version  # noqa: E402

if Version(h.VERL) < Version("0.9"):
    pytest.skip("the V1 (TransferQueue) trainer is verl 0.9's", allow_module_level=True)
pytest.importorskip("transfer_queue")
TOL = 1e-6
SKIPPED = "grpo_patches/old_logprob_rows_skipped"
#: (name, options, mini-batches, epochs, shuffle, dynamic)
CASES = [("2mb-shuffle-dynamic-filter", {"zero_advantage_filter": True}, 2, 1, True, True),
         ("4mb-static-nofilter", {"zero_advantage_filter": False}, 4, 1, False, False)]


def _worker(rank: int, port: int, out_dir: str, model_dir: str) -> None:
    from grpo_patches.testing import verl_minimal_pass_v1 as v1

    torch.set_num_threads(1)
    h.engine_setup(rank, 2, port)
    workers = {d: h.EngineWorker(model_dir, dynamic=d) for d in (False, True)}
    result = {}
    for name, options, n_mini, epochs, shuffle, dynamic in CASES:
        kw = dict(n_mini=n_mini, epochs=epochs, shuffle=shuffle, dynamic=dynamic, rank=rank, world=2,
                  worker=workers[dynamic])
        with contextlib.redirect_stdout(io.StringIO()):
            ref, got = v1.run(None, **kw), v1.run(options, **kw)
        result[name] = {"err": h.max_rel(got, ref), "steps": len(got.grads), "ref_rows": ref.forwards,
                        "rows": got.forwards, "skipped": got.metrics.get(SKIPPED, 0)}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def ws2(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl_minimal_pass_v1_ws2")
    model_dir = h.model_dir(str(out))
    mp.spawn(_worker, args=(h.free_port(), str(out), model_dir), nprocs=2, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_v1_minimal_pass_on_two_ranks(ws2, case, record_property):
    name, _, n_mini, epochs, _, _ = case
    for rank in ws2:
        r = rank[name]
        assert r["err"] <= TOL and r["steps"] == n_mini * epochs, r
        assert r["ref_rows"] == 2 * h.ROWS and r["rows"] + r["skipped"] == 2 * h.ROWS and r["skipped"] > 0, r
    assert ws2[0][name]["rows"] == ws2[1][name]["rows"]  # one trainer decision for both ranks
    record_property(f"exact_v1_minimal_pass_grad_rel_ws2_{name}", max(r[name]["err"] for r in ws2))
