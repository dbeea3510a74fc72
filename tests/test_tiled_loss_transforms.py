"""Model logit transforms in the tiled loss: ``logit_scale`` (Cohere, Granite) and ``logit_softcap`` (Gemma-2).

Tiled vs dense in fp32 (rel <= 1e-5) on the fast and the explicit-gradient paths, and gradcheck
in fp64 through the tanh.
"""

from __future__ import annotations

import pytest
import torch

from grpo_patches.errors import OptionError
from grpo_patches.tiled_loss import tiled_grpo_loss
from tests.tiled_loss_helpers import compare, make_case, max_rel

#: (logit_scale, logit_softcap): make_case's logits have std ~1.6, so a cap of 1.5 bends most of them
TRANSFORMS = {
    "scale": (0.625, None),
    "softcap": (1.0, 1.5),
    "scale_and_softcap": (1 / 1.7, 0.8),  # Muse: output_multiplier, then the softcap
}
#: fast path (no entropy term) and explicit path (entropy bonus), with / without temperature
VARIANTS = {
    "fast": dict(loss_type="dapo", old_logps=1, tile_size=4),
    "temperature_kl": dict(loss_type="grpo", old_logps=1, ref_logps=1, beta=0.05, temperature=0.7, tile_size=5,
                           return_logps=True),
    "entropy_bonus": dict(loss_type="bnpo", old_logps=1, entropy_coef=0.05, return_entropy=True, temperature=1.3,
                          tile_size=3),
    "sequence_level": dict(loss_type="luspo", old_logps=1, importance_sampling_level="sequence", tile_size=6),
}


@pytest.fixture(scope="module")
def case():
    return make_case()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
def test_transforms_match_dense(case, transform, variant):
    scale, cap = TRANSFORMS[transform]
    compare(case, logit_scale=scale, logit_softcap=cap, **VARIANTS[variant])


def test_transforms_change_the_loss(case):
    """The options are not no-ops (a dense that ignored them would still 'match')."""
    plain = compare(case, old_logps=1)[0][0]
    for scale, cap in TRANSFORMS.values():
        assert max_rel(compare(case, old_logps=1, logit_scale=scale, logit_softcap=cap)[0][0], plain) > 1e-2


def test_gradcheck_through_the_softcap():
    case = make_case(B=2, T=3, H=4, V=5, dtype=torch.float64, seed=11)
    case["mask"][1, 1] = 1.0
    labels, adv, mask = case["labels"], case["advantages"], case["mask"]
    old = case["old_logps"].double()
    for opts in (dict(loss_type="grpo", old_logps=old, temperature=0.8, tile_size=2),
                 dict(loss_type="dapo", old_logps=old, entropy_coef=0.05, tile_size=4)):
        def fn(h, w, b, opts=opts):
            return tiled_grpo_loss(h, w, labels, adv, mask, bias=b, logit_scale=1.3, logit_softcap=0.9,
                                   retain_grads=True, **opts)[0]

        inputs = tuple(case[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
        assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5), opts


@pytest.mark.parametrize("options, match", [
    (dict(logit_softcap=0.0), "logit_softcap"), (dict(logit_softcap=-30.0), "logit_softcap"),
    (dict(logit_scale=float("nan")), "logit_scale"),
])
def test_bad_transform_options_name_the_option(case, options, match):
    with pytest.raises(OptionError, match=match):
        tiled_grpo_loss(case["hidden"], case["weight"], case["labels"], case["advantages"], case["mask"], **options)
