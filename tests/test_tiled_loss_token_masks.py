"""Per-token multipliers that leave the denominators alone: ``policy_token_mask``, ``entropy_token_mask``.

Tiled vs dense for every aggregation in fp32 (rel <= 1e-5) and fp64; TRL 1.16's own
``_compute_loss`` with ``top_entropy_quantile < 1`` is the end-to-end reference in
``test_tiled_loss_trl.py``.
"""

from __future__ import annotations

import pytest
import torch

from grpo_patches.errors import OptionError
from grpo_patches.tiled_loss import AGGREGATIONS, dense_grpo_loss, tiled_grpo_loss
from tests.helpers.tiled_loss_helpers import assert_close, make_case, max_rel, run, trl_loss

DTYPE_RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _masked_case(dtype, seed=0):
    case = make_case(dtype=dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    case["policy_token_mask"] = torch.rand(case["mask"].shape, generator=g) > 0.4  # bool, as TRL's mask
    case["entropy_token_mask"] = (torch.rand(case["mask"].shape, generator=g) > 0.5).to(dtype)
    return case


def _run_masked(fn, case, **options):
    extra = {k: case[k] for k in ("policy_token_mask", "entropy_token_mask")}
    return run(lambda *a, **kw: fn(*a, **kw, **extra), case, **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_token_masks_match_dense_for_every_aggregation(aggregation, dtype):
    case = _masked_case(dtype)
    options = dict(aggregation=aggregation, old_logps=1, ref_logps=1, beta=0.05, entropy_coef=0.03,
                   entropy_aggregation="token-mean", tile_size=4, return_logps=True, return_entropy=True)
    tiled = _run_masked(tiled_grpo_loss, case, **options)
    dense = _run_masked(dense_grpo_loss, case, **options)
    assert_close(tiled, dense, DTYPE_RTOL[dtype], what=aggregation)
    unmasked = run(tiled_grpo_loss, case, **options)
    assert max_rel(tiled[0], unmasked[0]) > 1e-3  # the masks change the loss


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "luspo", "cispo", "vespo", "sapo"])
def test_policy_token_mask_with_every_objective(loss_type):
    case = _masked_case(torch.float32, seed=3)
    options = dict(old_logps=1, is_weights=1, tile_size=5)
    if loss_type == "cispo":
        options["epsilon_high"] = 1.1
    options = trl_loss(loss_type, **options)
    mask = case["policy_token_mask"]
    tiled = run(lambda *a, **kw: tiled_grpo_loss(*a, **kw, policy_token_mask=mask), case, **options)
    dense = run(lambda *a, **kw: dense_grpo_loss(*a, **kw, policy_token_mask=mask), case, **options)
    assert_close(tiled, dense, what=loss_type)


def test_denominators_stay_the_masks():
    """token-mean with a policy mask = the masked tokens' losses over *all* unmasked tokens."""
    case = _masked_case(torch.float64, seed=5)
    keep = case["policy_token_mask"].to(torch.float64)
    args = (case["hidden"], case["weight"], case["labels"], case["advantages"])
    masked, metrics = tiled_grpo_loss(*args, case["mask"], policy_token_mask=keep, old_logps=case["old_logps"],
                                      return_token_metrics=True)
    count = case["mask"].sum()
    same, _ = tiled_grpo_loss(*args, case["mask"] * keep, old_logps=case["old_logps"], normalizer=float(count))
    assert max_rel(masked, same) <= 1e-12
    assert metrics["token_count"] == count  # metrics stay over the mask


def test_mask_shapes_are_checked():
    case = make_case()
    args = (case["hidden"], case["weight"], case["labels"], case["advantages"], case["mask"])
    with pytest.raises(OptionError, match="policy_token_mask"):
        tiled_grpo_loss(*args, policy_token_mask=torch.ones(3))
    with pytest.raises(OptionError, match="entropy_token_mask"):
        tiled_grpo_loss(*args, entropy_token_mask=torch.ones(3))
