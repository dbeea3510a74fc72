"""``pack_kept_rows`` under data parallelism: TRL's GRPOTrainer on 2 gloo processes (accelerate's
MULTI_CPU), each rank with its own prompts, so its own number of kept rows.

The rank with the most kept rows decides how many micro-batches hold kept rows on every rank
(the others top theirs up with zero-advantage rows): both ranks run the same forward/backward
calls, DDP reduces in the window's last micro-step, which always has kept rows, and each
optimizer step's reduced gradient equals the unpatched run's.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from tests.helpers.spawned_ranks import finish_rank, rank_environment, run_ranks_on_the_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

WORLD = 2
CONFIG = dict(steps=2, optim="sgd", bf16=False, count_forwards=True, gradient_accumulation_steps=4,
              steps_per_generation=4, loss_type="grpo")  # grpo: in every TRL, and packed
OPTIONS = dict(recompute=False, logprob_skip=False, zero_advantage_filter=True, pack_kept_rows=True)


def _worker(rank: int, port: int, out_dir: str, model_path: str) -> None:
    rank_environment(rank, port, WORLD)
    from grpo_patches.demo import tiny_model
    from grpo_patches_testing.trl_train import train
    from tests.helpers.trl_gradients import Gradients

    out: dict = {}
    for name, patched in (("off", False), ("on", True)):
        grads = Gradients()
        result = train(patched, OPTIONS if patched else None, model_path=model_path, callbacks=[grads.callback],
                       reward_funcs=tiny_model.reward_constant_per_prompt, **CONFIG)
        out[name] = {"grads": grads.steps, "calls": result.forwards.with_grad_calls,
                     "skipped": result.savings.get("micro_batches_dropped", 0),
                     "rows_dropped": result.savings.get("rows_dropped", 0)}
    finish_rank(out_dir, rank, out)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_ranks_on_the_tiny_model(_worker, tmp_path_factory.mktemp("packing_ddp"), WORLD, timeout=600)


def test_two_ranks_pack_alike_and_keep_the_reduced_gradient(ranks):
    from tests.helpers.trl_gradients import rel_l2

    for rank in ranks:
        assert len(rank["off"]["grads"]) == len(rank["on"]["grads"]) == 2
        diffs = [rel_l2(a, b) for a, b in zip(rank["on"]["grads"], rank["off"]["grads"])]
        assert max(diffs) <= 1e-6, diffs
        assert rank["on"]["skipped"] > 0 and rank["on"]["calls"] == rank["off"]["calls"] - rank["on"]["skipped"]
    assert ranks[0]["on"]["calls"] == ranks[1]["on"]["calls"]  # the same calls on every rank
    assert ranks[0]["on"]["skipped"] == ranks[1]["on"]["skipped"]
