"""The zero-advantage filter in NeMo-RL's real Megatron worker (v0.7.0) at tensor parallel 2 and pipeline parallel 2.

Two spawned gloo processes per topology (:mod:`tests.compat_nemo_rl.megatron_model_parallel`):
``MegatronPolicyWorkerImpl.train`` on a tiny megatron-core ``GPTModel`` split over the two ranks
(vocabulary-parallel output and column / row-parallel layers at TP 2; one layer per stage and
megatron-core's 1F1B schedule with fixed-shape p2p activations at PP 2), patched vs unpatched from
the same weights: each rank's gradient shard before each of the two optimizer steps equal (fp32,
rel <= 1e-6), fewer rows through the autograd forward, both ranks the same plan (the same
micro-batches, by rows and token sums), NeMo-RL's loss sum unchanged, ``get_logprobs`` bitwise
unchanged; the planted renormalising filter is caught on every rank. Skips without a NeMo-RL source
(v0.7.0) or Megatron-Bridge on the path.

In bf16 (:mod:`tests.helpers.megatron_tier`: the gpu tier, NCCL with one GPU a rank, skipped on fewer than two
GPUs; or ``GRPO_PATCHES_MEGATRON_BF16=1`` on a CPU) each rank compares with its noise floor: twice what
re-batching the same rows (6 a micro-batch, each global batch in one, instead of 2) moves unpatched, gradient
and loss sum; the planted fault must land above both the floor and 1e-2.
"""

from __future__ import annotations

import multiprocessing
import socket

import pytest

from tests.compat_nemo_rl import megatron_model_parallel as ranks
from tests.compat_nemo_rl.megatron_dp2 import run_ranks
from tests.helpers import nemo_rl_megatron_harness as harness
from tests.helpers.megatron_tier import skip_unless_gpus
from tests.helpers.nemo_worker_harness import ZERO_ROWS

harness.setup()  # skips the module without a NeMo-RL source or Megatron-Bridge (its gloo group stays here)

#: rows through the autograd forward, patched: 3 kept rows per global batch in micro-batches of 2; at PP 2
#: the short last one is filled to 2 rows with zero-weight rows (the schedule's fixed activation shape)
ROWS_PATCHED = {"tp2": 12 - len(ZERO_ROWS), "pp2": 8}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("topology", list(ranks.TOPOLOGIES))
def test_filter_exact_with_the_same_plan_on_both_ranks(topology, record_property):
    skip_unless_gpus(2)
    results = run_ranks(multiprocessing.get_context("spawn"), _free_port(), target=ranks.run_rank, args=(topology,))
    for rank in results:
        record_property(f"exact_megatron_filter_{topology}_rank{rank['rank']}_grad_rel", rank["grad_rel"])
        record_property(f"fault_renormalised_grad_rel_{topology}_rank{rank['rank']}", rank["fault_rel"])
        record_property(f"megatron_filter_{topology}_rank{rank['rank']}_tolerance_grad_rel", rank["tol"])
        assert rank["grad_rel"] <= rank["tol"] and rank["grad_norm"] > 0, rank  # fp32: 1e-6
        assert rank["fault_rel"] > max(1e-2, rank["tol"]), rank  # the comparison can fail
        assert rank["steps"] == [2, 2] and rank["note"].startswith("on"), rank
        assert rank["rows_base"] == 12 and rank["rows_patched"] == ROWS_PATCHED[topology], rank
        assert rank["microbatches_base"] == 6 and len(rank["plan"]) == 4, rank
        assert abs(rank["loss_patched"] - rank["loss_base"]) <= rank["loss_tol"], rank  # fp32: 1e-6
        assert rank["rows_dropped"] == [float(len(ZERO_ROWS))] and rank["micro_batches_dropped"] == [2.0], rank
        assert rank["logprobs_equal"], rank
    assert results[0]["plan"] == results[1]["plan"]  # every TP rank / pipeline stage ran the same micro-batches
    record_property(f"saved_megatron_filter_{topology}_autograd_rows", results[0]["rows_base"] - results[0]["rows_patched"])
