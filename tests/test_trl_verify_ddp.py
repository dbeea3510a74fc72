"""Verify mode under data parallelism: TRL's GRPOTrainer on 2 gloo processes (accelerate's
MULTI_CPU), each rank with its own prompts, so its own zero-advantage rows and figures.

Every rank verifies every micro-step and :func:`grpo_patches.verify.check` agrees on each figure
(one all-reduce, the maximum): the ranks log the same figures and reach the same verdict. A
plugin that drops a row with a non-zero advantage on rank 1 only makes both ranks raise on the
first verify step (rank 0's own difference is ~1e-7): neither hangs in a collective nor trains on.
In bf16 with the tiled loss, the fp32 reference is found under the DDP wrapper (Accelerate's
autocast forward sits on the inner module): TRL's own bf16 distance from it is real, no alarm.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from tests.helpers.spawned_ranks import finish_rank, rank_environment, run_ranks_on_the_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

WORLD = 2


def _worker(rank: int, port: int, out_dir: str, model_path: str) -> None:
    """Both scenarios in one process pair (TRL is imported once): correct code, then the fault."""
    rank_environment(rank, port, WORLD)
    from grpo_patches import verify_log
    from grpo_patches.demo import tiny_model
    from grpo_patches.errors import ExactnessError
    from tests.helpers.faulty_plugins import DropsANonZeroRow, past_the_contract
    from grpo_patches_testing.trl_train import train

    outcomes: dict = {}
    for scenario in ("correct", "fault", "bf16_tiled"):
        plugins = [DropsANonZeroRow()] if scenario == "fault" and rank == 1 else []
        bf16 = scenario == "bf16_tiled"
        outcome = outcomes[scenario] = {}
        verify_log.reset("trl")
        try:
            with past_the_contract():  # the planted fault breaks the filter's contract: verify mode is under test
                result = train(True, {"verify_every": 1, "tiled_loss": bf16}, steps=1, plugins=plugins,
                               model_path=model_path, reward_funcs=tiny_model.reward_constant_per_prompt, bf16=bf16,
                               optim="sgd")
            outcome["rows"] = [{k: v for k, v in row.items() if k.startswith("grpo_patches/verify/")}
                               for row in result.log_history if "loss" in row]
            outcome["verify"] = result.status["verify"]
            outcome["rows_dropped"] = result.savings.get("rows_dropped", 0)
        except ExactnessError as err:
            outcome["error"] = (err.step, err.quantity, err.optimizations, err.measured)
    finish_rank(out_dir, rank, outcomes)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks_on_the_tiny_model(_worker, tmp_path_factory.mktemp("verify_ddp"), WORLD, timeout=600)


def test_two_ranks_verify_and_agree(ranks):
    correct = [rank["correct"] for rank in ranks]
    assert all("error" not in rank for rank in correct)
    assert correct[0]["rows"] == correct[1]["rows"] and len(correct[0]["rows"]) == 1
    (figures,) = correct[0]["rows"]
    assert figures["grpo_patches/verify/grad_rel_diff"] <= 1e-5
    assert correct[0]["verify"] == correct[1]["verify"] and correct[0]["verify"]["failures"] == []
    assert correct[0]["rows_dropped"] > 0 and correct[1]["rows_dropped"] > 0


def test_a_fault_on_one_rank_stops_both(ranks):
    errors = [rank["fault"].get("error") for rank in ranks]
    assert errors[0] is not None and errors[0] == errors[1]  # the same agreed figure on both ranks
    step, quantity, optimizations, measured = errors[0]
    assert (step, quantity) == (0, "grad_rel_diff") and "zero_advantage_filter" in optimizations and measured > 1e-3


def test_bf16_tiled_loss_is_judged_against_an_fp32_reference_under_ddp(ranks):
    got = [rank["bf16_tiled"] for rank in ranks]
    assert all("error" not in rank for rank in got), [rank.get("error") for rank in got]
    assert got[0]["rows"] == got[1]["rows"] and got[0]["verify"]["failures"] == []
    (figures,) = got[0]["rows"]
    floor = figures["grpo_patches/verify/grad_noise_floor"]
    assert 1e-4 < floor < 3e-2 and figures["grpo_patches/verify/grad_rel_diff"] <= 2 * floor
