"""The minimal old-logprob pass (option ``recompute``) on two data-parallel ranks (FSDP2 over gloo),
through the legacy ``RayPPOTrainer`` and (verl 0.9+) the V1 ``PPOTrainer`` (TransferQueue).

Each rank runs the trainer's real ``_compute_old_log_prob`` / ``_update_actor`` with a worker
group that hands the update its own chunk (the contiguous rows; on V1 ``KVBatchMeta.chunk``), as
verl's dispatch does; the engine line shuffles each rank's mini-batches with its own seed
(``data_loader_seed + rank``), so the rows each rank consumes first differ. Every per-step
gradient equals verl's with the whole pass (rel <= 1e-6), the rows skipped are counted, and both
ranks get one trainer decision. A wrong plan on either rank would stop that rank with a
``PlaceholderError`` (the planted faults: ``test_verl_minimal_pass.py``, ``..._v1.py``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
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

if Version(h.VERL) < Version("0.7"):
    pytest.skip("the minimal pass needs verl >= 0.7", allow_module_level=True)
LEGACY = h.line().startswith("legacy")
V1 = Version(h.VERL) >= Version("0.9") and importlib.util.find_spec("transfer_queue") is not None
TOL = 1e-6
SKIPPED = "grpo_patches/old_logprob_rows_skipped"
#: (name, options, mini-batches, epochs, shuffle, dynamic)
CASES = [("2mb-shuffle-dynamic-filter", {"zero_advantage_filter": True}, 2, 1, True, True),
         ("4mb-static-nofilter", {"zero_advantage_filter": False}, 4, 1, False, False),
         ("2mb-2epochs-shuffle-filter", {"zero_advantage_filter": True}, 2, 2, True, False)]
#: the cases each trainer runs (V1: the two that differ in its key handling)
TRAINERS = {"RayPPOTrainer": [c[0] for c in CASES], "V1": [c[0] for c in CASES[:2]]}


def _runner(trainer: str):
    if trainer == "V1":
        from grpo_patches_testing import verl_minimal_pass_v1 as runner
    else:
        from grpo_patches_testing import verl_minimal_pass as runner
    return runner


def _worker(rank: int, port: int, out_dir: str, model_dir: str, trainer: str) -> None:
    torch.set_num_threads(1)
    legacy = LEGACY and trainer != "V1"
    if legacy:
        h.init_pg(rank, 2, port)
    else:
        engine_runs.engine_setup(rank, 2, port)
    workers = {} if legacy else {d: engine_runs.EngineWorker(model_dir, dynamic=d) for d in (False, True)}
    run, result = _runner(trainer).run, {}
    for name, options, n_mini, epochs, shuffle, dynamic in CASES:
        if name not in TRAINERS[trainer]:
            continue
        kw = dict(n_mini=n_mini, epochs=epochs, shuffle=shuffle, dynamic=dynamic, rank=rank, world=2,
                  worker=workers.get(dynamic))
        if trainer != "V1":
            kw["shard"] = legacy
        with contextlib.redirect_stdout(io.StringIO()):
            ref, got = run(None, **kw), run(options, **kw)
        result[name] = {"err": h.max_rel(got, ref), "steps": len(got.grads), "ref_rows": ref.forwards,
                        "rows": got.forwards, "skipped": got.metrics.get(SKIPPED, 0)}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module", params=list(TRAINERS))
def ws2(request, tmp_path_factory):
    trainer = request.param
    if trainer == "V1" and not V1:
        pytest.skip("the V1 (TransferQueue) trainer is verl 0.9's")
    out = tmp_path_factory.mktemp(f"verl_minimal_pass_ws2_{trainer}")
    model_dir = "" if LEGACY and trainer != "V1" else h.model_dir(str(out))
    mp.spawn(_worker, args=(h.free_port(), str(out), model_dir, trainer), nprocs=2, join=True)
    return trainer, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_minimal_pass_on_two_ranks(ws2, case, record_property):
    trainer, ranks = ws2
    name, _, n_mini, epochs, _, _ = case
    if name not in TRAINERS[trainer]:
        pytest.skip(f"{name} runs on the legacy trainer only")
    for rank in ranks:
        r = rank[name]
        assert r["err"] <= TOL and r["steps"] == n_mini * epochs, r
        assert r["ref_rows"] == 2 * h.ROWS and r["rows"] + r["skipped"] == 2 * h.ROWS and r["skipped"] > 0, r
    assert ranks[0][name]["rows"] == ranks[1][name]["rows"]  # one trainer decision for both ranks
    prefix = "exact_v1_minimal_pass" if trainer == "V1" else "exact_minimal_pass"
    record_property(f"{prefix}_grad_rel_ws2_{name}", max(r[name]["err"] for r in ranks))
