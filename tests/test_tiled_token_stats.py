"""The no-grad tiled pass :func:`tiled_token_stats`: per-token log-probs and entropies.

What an adapter computes TRL's high-entropy mask from (``top_entropy_quantile < 1``) before the
loss. Checked against the dense path, the loss's own per-token outputs, the hook's default and
the logits of real (tiny, random) HF models with their logit transforms.
"""

from __future__ import annotations

import pytest
import torch

from grpo_patches.errors import OptionError
from grpo_patches.tiled_loss import dense_grpo_loss, tiled_grpo_loss, tiled_token_stats
from tests.helpers.tiled_loss_helpers import make_case, max_rel, run, trl_loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("transform", [dict(), dict(temperature=0.7, logit_scale=0.8, logit_softcap=1.5)])
def test_token_stats_match_dense(dtype, transform):
    case = make_case(B=3, T=11, dtype=dtype, seed=9)
    options = trl_loss("grpo", return_logps=True, return_entropy=True, **transform)
    _, dense, _ = run(dense_grpo_loss, case, **options)
    _, tiled, _ = run(tiled_grpo_loss, case, **options)
    for tile in (1, 4, None):
        logps, entropy = tiled_token_stats(case["hidden"], case["weight"], case["labels"], case["mask"],
                                           bias=case["bias"], tile_size=tile, **transform)
        assert logps.shape == entropy.shape == case["labels"].shape and not logps.requires_grad
        assert logps.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        rtol = 1e-5 if dtype != torch.bfloat16 else 2e-2  # bf16: dense rounds its logits, the tiled pass does not
        assert max_rel(logps, dense["logps"]) <= rtol and max_rel(entropy, dense["entropy"]) <= rtol
        assert (logps[case["mask"] == 0] == 0).all() and (entropy[case["mask"] == 0] == 0).all()
        # the loss's own per-token outputs: the same logits, so the same numbers
        assert max_rel(logps, tiled["logps"]) <= 1e-6 and max_rel(entropy, tiled["entropy"]) <= 1e-6


def test_token_stats_flat_inputs_and_no_mask():
    case = make_case(bias=False, seed=2)
    flat_h, flat_y = case["hidden"].reshape(-1, case["hidden"].shape[-1]), case["labels"].reshape(-1)
    logps, entropy = tiled_token_stats(flat_h, case["weight"], flat_y, tile_size=4)
    log_probs = torch.log_softmax(flat_h @ case["weight"].t(), -1)
    assert max_rel(logps, log_probs.gather(1, flat_y[:, None]).squeeze(1)) <= 1e-5
    assert max_rel(entropy, -(log_probs.exp() * log_probs).sum(-1)) <= 1e-5
    with pytest.raises(OptionError, match="logit_softcap"):
        tiled_token_stats(flat_h, case["weight"], flat_y, logit_softcap=0.0)


def test_token_stats_hook_default():
    from grpo_patches.plugins import hook

    case = make_case(seed=4)
    logps, entropy = hook().grpo_lm_head_token_stats(
        hidden=case["hidden"], weight=case["weight"], labels=case["labels"], mask=case["mask"],
        options={"bias": case["bias"], "temperature": 0.9, "tile_size": 4},
    )
    ref = tiled_token_stats(case["hidden"], case["weight"], case["labels"], case["mask"], bias=case["bias"],
                            temperature=0.9)
    assert max_rel(logps, ref[0]) <= 1e-6 and max_rel(entropy, ref[1]) <= 1e-6
