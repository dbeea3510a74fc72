"""Tiled GRPO loss vs the dense reference: loss, every gradient and every metric, fp32 rel <= 1e-5."""

from __future__ import annotations

import pytest
import torch

from grpo_patches.errors import OptionError
from grpo_patches.adapters.trl.loss_modes import LOSS_TYPES as TRL_LOSS_TYPES
from grpo_patches.adapters.trl.loss_modes import tiled_loss_preset
from grpo_patches.tiled_loss import dense_grpo_loss, tiled_grpo_loss
from tests.helpers.tiled_loss_helpers import assert_close, compare, make_case, max_rel, run, trl_loss

#: option variants applied to every TRL loss type (tile sizes that do not divide the 21 tokens)
VARIANTS = {
    "on_policy": dict(tile_size=4),
    "kl_temp_is": dict(
        old_logps=1, ref_logps=1, is_weights=1, beta=0.04, kl_ratio_correction=True, temperature=0.7, tile_size=5
    ),
    "entropy_outputs": dict(
        old_logps=1, entropy_coef=0.01, return_entropy=True, return_logps=True, return_token_metrics=True,
        epsilon_high=0.28, tile_size=3,
    ),
    "sequence_level": dict(old_logps=1, importance_sampling_level="sequence", normalizer=5.0, tile_size=6),
    "kl_k2_opsm": dict(
        old_logps=1, ref_logps=1, sampling_logps=1, beta=0.1, kl_estimator="k2", kl_clamp=0.5,
        log_ratio_clamp=0.25, off_policy_mask_threshold=0.05, return_token_metrics=True,
    ),
    "kl_k1_dual_clip": dict(old_logps=1, ref_logps=1, beta=0.1, kl_estimator="k1", delta=1.5, tile_size=2),
}


def _loss_type_options(loss_type: str, variant: dict) -> dict:
    options = dict(variant)
    if loss_type == "cispo":
        options["epsilon_high"] = 1.1  # TRL caps the CISPO ratio at epsilon_high itself
    if loss_type == "dr_grpo":
        options["max_completion_length"] = 9
    return trl_loss(loss_type, **options)


@pytest.fixture(scope="module")
def case():
    return make_case()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("loss_type", sorted(TRL_LOSS_TYPES))
def test_trl_loss_types_match_dense(case, loss_type, variant):
    tiled, _ = compare(case, **_loss_type_options(loss_type, VARIANTS[variant]))
    assert tiled[1]["token_count"] == case["mask"].sum()


@pytest.mark.parametrize(
    "aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"]
)
@pytest.mark.parametrize("normalizer", [None, 7.0])
def test_verl_and_nemo_aggregations_match_dense(case, aggregation, normalizer):
    """verl agg modes; NeMo token / sequence level = token-mean / seq-mean-token-mean with a global normalizer."""
    compare(case, aggregation=aggregation, normalizer=normalizer, old_logps=1, log_ratio_clamp=20.0,
            ref_logps=1, beta=0.001, kl_estimator="k3", kl_clamp=10.0, delta=3.0, tile_size=4,
            entropy_coef=0.02, entropy_aggregation="token-mean")


def test_a_callable_kl_estimator_is_called_per_token(case):
    """A framework's own estimator (verl's kl_penalty, with its clamps) instead of k1/k2/k3."""

    def clamped_k3(logps, ref_logps):  # verl's low_var_kl, written out
        kl = torch.clamp(ref_logps - logps, min=-20, max=20)
        return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)

    options = dict(old_logps=1, ref_logps=1, beta=0.05, tile_size=3)
    tiled, _ = compare(case, kl_estimator=clamped_k3, **options)
    builtin = run(tiled_grpo_loss, case, kl_estimator="k3", kl_clamp=10.0, **options)
    assert torch.allclose(tiled[0], builtin[0], rtol=1e-6)  # no log-ratio beyond 20 here: the same value
    shifted = run(tiled_grpo_loss, case, kl_estimator=lambda lp, ref: clamped_k3(lp, ref) + lp, **options)
    assert not torch.allclose(shifted[2]["hidden"], tiled[2]["hidden"])  # the callable's gradient is used


def test_per_token_advantages_and_float_mask():
    case = make_case(per_token_adv=True, seed=3)
    case["mask"] = case["mask"] * torch.rand(case["mask"].shape)  # NeMo-style token * sample weights
    compare(case, **trl_loss("grpo", old_logps=1, tile_size=5))


@pytest.mark.parametrize(
    "shape",
    [dict(B=1, T=1), dict(B=2, T=1), dict(B=1, T=13, V=2), dict(B=5, T=3, V=101, H=7), dict(B=4, T=9, V=1)],
)
def test_odd_shapes(shape):
    case = make_case(**shape, seed=5)
    case["mask"][0, 0] = 1.0  # at least one token
    for tile in (1, 3, None):
        compare(case, **trl_loss("grpo", old_logps=1, ref_logps=1, beta=0.1, tile_size=tile, return_logps=True))
        compare(case, **trl_loss("luspo", old_logps=1, importance_sampling_level="sequence", tile_size=tile))


def test_flat_inputs_and_no_bias():
    case = make_case(bias=False, seed=7)
    flat = {k: (v.reshape(-1, v.shape[-1]) if k == "hidden" else v.reshape(-1)) if torch.is_tensor(v) and k != "weight"
            else v for k, v in case.items()}
    flat["advantages"] = case["advantages"][:, None].expand(case["mask"].shape).reshape(-1)
    compare(flat, old_logps=1, tile_size=4, return_logps=True)
    with pytest.raises(OptionError, match="needs rows"):
        tiled_grpo_loss(flat["hidden"], flat["weight"], flat["labels"], flat["advantages"], flat["mask"],
                        **trl_loss("grpo"))


def test_everything_masked_gives_zero_loss_and_zero_grads(case):
    empty = dict(case, mask=torch.zeros_like(case["mask"]))
    tiled, dense = compare(empty, **trl_loss("dapo", old_logps=1, return_logps=True))
    assert tiled[0] == 0 and all((g == 0).all() for g in tiled[2].values())


def test_default_tile_budget_and_one_tile_equal_many_tiles(case):
    one = run(tiled_grpo_loss, case, old_logps=1, tile_memory_bytes=1)  # budget floor: 16-token tiles
    many = run(tiled_grpo_loss, case, old_logps=1, tile_size=1)
    assert_close(one, many)


def test_gradcheck_float64():
    case = make_case(B=2, T=3, H=4, V=5, dtype=torch.float64, seed=11)
    case["mask"][1, 1] = 1.0
    labels, adv, mask = case["labels"], case["advantages"], case["mask"]
    old = case["old_logps"].double()
    ref = case["ref_logps"].double()
    option_sets = [
        trl_loss("grpo", old_logps=old, ref_logps=ref, beta=0.1, temperature=0.8, tile_size=2),
        # (on-policy old_logps=None is a detach trick: its value has no slope, so it is not gradcheck-able)
        trl_loss("dapo", old_logps=old, entropy_coef=0.05, tile_size=4),
        trl_loss("sapo", old_logps=old, importance_sampling_level="sequence", tile_size=1),
    ]
    for opts in option_sets:
        def fn(h, w, b, opts=opts):
            return tiled_grpo_loss(h, w, labels, adv, mask, bias=b, retain_grads=True, **opts)[0]

        inputs = (case["hidden"].clone().requires_grad_(), case["weight"].clone().requires_grad_(),
                  case["bias"].clone().requires_grad_())
        assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-5), opts


@pytest.mark.parametrize("options", [trl_loss("dapo"), trl_loss("grpo", entropy_coef=0.1, temperature=0.5)])
def test_gradients_scale_with_incoming_gradient(case, options):
    """(loss * 3).backward() gives 3x every gradient, the weight's included."""
    _, _, once = run(tiled_grpo_loss, case, old_logps=1, tile_size=4, **options)
    _, _, three = run(tiled_grpo_loss, case, k=3.0, old_logps=1, tile_size=4, **options)
    for name in ("hidden", "weight", "bias"):
        assert max_rel(three[name], 3 * once[name]) <= 1e-6, name


def test_tied_embeddings_accumulate_both_paths():
    torch.manual_seed(0)
    V, H = 41, 12
    ids = torch.randint(0, V, (3, 6))
    labels = torch.randint(0, V, (3, 6))
    adv, mask = torch.randn(3), torch.ones(3, 6)
    grads = []
    for fn in (tiled_grpo_loss, dense_grpo_loss):
        torch.manual_seed(1)
        emb = torch.nn.Embedding(V, H)
        proj = torch.nn.Linear(H, H)
        hidden = torch.tanh(proj(emb(ids)))
        loss, _ = fn(hidden, emb.weight, labels, adv, mask, **trl_loss("grpo", tile_size=5))
        loss.backward()
        grads.append((emb.weight.grad.clone(), proj.weight.grad.clone()))
    assert max_rel(grads[0][0], grads[1][0]) <= 1e-5
    assert max_rel(grads[0][1], grads[1][1]) <= 1e-5


def test_no_grad_and_frozen_weight(case):
    with torch.no_grad():
        loss, _ = tiled_grpo_loss(case["hidden"], case["weight"], case["labels"], case["advantages"], case["mask"])
    assert loss.grad_fn is None
    hidden = case["hidden"].clone().requires_grad_()
    loss, _ = tiled_grpo_loss(
        hidden, case["weight"], case["labels"], case["advantages"], case["mask"], bias=case["bias"], tile_size=4
    )
    loss.backward()
    ref = run(dense_grpo_loss, case)[2]["hidden"]
    assert max_rel(hidden.grad, ref) <= 1e-5


def test_second_backward_is_refused(case):
    hidden = case["hidden"].clone().requires_grad_()
    loss, _ = tiled_grpo_loss(hidden, case["weight"], case["labels"], case["advantages"], case["mask"])
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_hook_default_calls_tiled_loss(case):
    from grpo_patches.plugins import hook

    options = trl_loss("grpo", old_logps=case["old_logps"], bias=case["bias"], tile_size=4)
    loss, metrics = hook().grpo_lm_head_loss(
        hidden=case["hidden"], weight=case["weight"], labels=case["labels"], advantages=case["advantages"],
        mask=case["mask"], options=options,
    )
    ref, ref_metrics = dense_grpo_loss(case["hidden"], case["weight"], case["labels"], case["advantages"],
                                       case["mask"], **options)
    assert max_rel(loss, ref) <= 1e-5 and set(metrics) == set(ref_metrics)


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(loss_type="ppo"), "loss_type='ppo'"),
        (dict(aggregation="mean"), "aggregation='mean'"),
        (dict(kl_estimator="k4"), "kl_estimator"),
        (dict(beta=0.1), "needs ref_logps"),
        (dict(tile_size=0), "tile_size"),
        (dict(delta=0.9), "delta"),
        (dict(epsilon=0.2), "unknown tiled_grpo_loss option"),
        (dict(importance_sampling_level="row"), "importance_sampling_level"),
    ],
)
def test_bad_options_name_the_option(case, options, match):
    with pytest.raises(OptionError, match=match):
        tiled_grpo_loss(case["hidden"], case["weight"], case["labels"], case["advantages"], case["mask"], **options)


def test_trl_loss_types_are_the_trl_adapters_presets():
    """TRL's ``loss_type`` names live in the TRL adapter, in the tiled loss's own vocabulary."""
    assert tiled_loss_preset("grpo") == {"objective": "clip", "aggregation": "seq-mean-token-mean"}
    assert tiled_loss_preset("cispo", epsilon_high=5.0)["cispo_max_ratio"] == 5.0  # TRL's cap is epsilon_high
    with pytest.raises(OptionError, match="loss_type='ppo' is not supported; use one of 'grpo'"):
        tiled_loss_preset("ppo")
