"""Model logit transforms in the tiled loss: ``logit_scale`` (Cohere, Granite) and ``logit_softcap`` (Gemma-2).

Tiled vs dense in fp32 (rel <= 1e-5) on the fast and the explicit-gradient paths, gradcheck in
fp64 through the tanh, and the logits of real (tiny, random) HF models: the options reproduce
``log_softmax(model(...).logits / T)`` for the config attribute each model family uses.
"""

from __future__ import annotations

import pytest
import torch

from grpo_patches.errors import OptionError
from grpo_patches.tiled_loss import tiled_grpo_loss, tiled_token_stats
from tests.helpers.tiled_loss_helpers import compare, make_case, max_rel, trl_loss

#: (logit_scale, logit_softcap): make_case's logits have std ~1.6, so a cap of 1.5 bends most of them
TRANSFORMS = {
    "scale": (0.625, None),
    "softcap": (1.0, 1.5),
    "scale_and_softcap": (1 / 1.7, 0.8),  # Muse: output_multiplier, then the softcap
}
#: fast path (no entropy term) and explicit path (entropy bonus), with / without temperature
VARIANTS = {
    "fast": trl_loss("dapo", old_logps=1, tile_size=4),
    "temperature_kl": trl_loss("grpo", old_logps=1, ref_logps=1, beta=0.05, temperature=0.7, tile_size=5,
                           return_logps=True),
    "entropy_bonus": trl_loss("bnpo", old_logps=1, entropy_coef=0.05, return_entropy=True, temperature=1.3,
                          tile_size=3),
    "sequence_level": trl_loss("luspo", old_logps=1, importance_sampling_level="sequence", tile_size=6),
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
    for opts in (trl_loss("grpo", old_logps=old, temperature=0.8, tile_size=2),
                 trl_loss("dapo", old_logps=old, entropy_coef=0.05, tile_size=4)):
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


def transform_options(config) -> dict:
    """Config attribute -> option, as an adapter maps it (the same table as TRL 1.16's fused head)."""
    cap = getattr(config, "final_logit_softcapping", None)
    scale = getattr(config, "logit_scale", None)
    for name in ("output_multiplier", "lm_head_multiplier"):
        scale = getattr(config, name, None) if scale is None else scale
    if scale is None and getattr(config, "logits_scaling", None) is not None:  # Granite divides by it
        scale = config.logits_scaling if config.model_type == "hyperclovax" else 1 / config.logits_scaling
    return dict(logit_scale=1.0 if scale is None else scale, logit_softcap=cap)


def _tiny(name: str):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=64, attn_implementation="eager")
    configs = {
        "gemma2": lambda: transformers.Gemma2Config(final_logit_softcapping=2.0, **common),
        "gemma3": lambda: transformers.Gemma3TextConfig(final_logit_softcapping=2.0, **common),
        "cohere": lambda: transformers.CohereConfig(logit_scale=0.3, **common),
        "cohere2": lambda: transformers.Cohere2Config(logit_scale=0.3, **common),
        "granite": lambda: transformers.GraniteConfig(logits_scaling=4.0, **common),
    }
    config = configs[name]()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "cohere", "cohere2", "granite"])
def test_options_reproduce_hf_model_logits(family):
    model = _tiny(family)
    options = transform_options(model.config)
    assert options != dict(logit_scale=1.0, logit_softcap=None), "the tiny config must transform its logits"
    with torch.no_grad():  # make the transform matter: logits well beyond the cap / scale
        model.get_output_embeddings().weight.mul_(20.0)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    temperature = 0.7
    with torch.no_grad():
        hidden = model.base_model(ids).last_hidden_state[:, :-1]  # what the lm-head sees
        labels = ids[:, 1:]
        log_probs = torch.log_softmax(model(ids).logits[:, :-1].float() / temperature, -1)
        expected = log_probs.gather(-1, labels[..., None]).squeeze(-1)
        expected_entropy = -(log_probs.exp() * log_probs).sum(-1)
    head = model.get_output_embeddings()
    logps, entropy = tiled_token_stats(hidden, head.weight, labels, bias=head.bias, temperature=temperature,
                                       tile_size=5, **options)
    assert max_rel(logps, expected) <= 1e-5 and max_rel(entropy, expected_entropy) <= 1e-5
    plain, _ = tiled_token_stats(hidden, head.weight, labels, bias=head.bias, temperature=temperature)
    assert max_rel(plain, expected) > 1e-2  # without the options the logits differ
