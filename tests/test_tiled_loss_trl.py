"""The tiled loss reproduces TRL 1.16's own ``GRPOTrainer._compute_loss`` for every loss type.

TRL's method runs unchanged on a stand-in trainer whose policy forward returns dense
log-probs of ``hidden @ weight.T / temperature``; the tiled loss gets the options the TRL
adapter computes for that trainer (:func:`grpo_patches.adapters.trl.tiled_options.loss_options`).
Compared: loss, gradients of hidden and weight, and the logged metrics.
"""

from __future__ import annotations

import functools
import types
from collections import defaultdict

import pytest
import torch

from grpo_patches.adapters.trl.tiled_options import loss_options
from grpo_patches.tiled_loss import tiled_grpo_loss, tiled_token_stats
from tests.helpers.tiled_loss_helpers import make_case, max_rel


def _supported_trl() -> bool:
    import trl
    from packaging.version import Version

    return Version(trl.__version__) >= Version("1.16")


grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
GRPOTrainer = grpo_trainer.GRPOTrainer
if not _supported_trl():  # pragma: no cover - compat runs against older TRL
    pytest.skip("the stand-in trainer mirrors TRL 1.16's _compute_loss", allow_module_level=True)

GA, SPG, TEMPERATURE, MAX_LEN = 3, 2, 0.8, 9
NUM_ITEMS = 40.0  # num_items_in_batch of the generation batch


def _fake_trainer(loss_type, hidden, weight, *, beta, level, delta, entropy_coef, is_ratio, top_entropy_quantile=1.0):
    def per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        logits = (hidden @ weight.t()) / TEMPERATURE
        log_probs = torch.log_softmax(logits, -1)
        logps = log_probs.gather(-1, input_ids[:, -logits_to_keep:, None]).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
        return logps, entropy, None

    args = types.SimpleNamespace(
        use_bias_correction_kl=True, delta=delta, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
        vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, steps_per_generation=SPG,
    )
    identity = lambda x, **kw: x  # noqa: E731 - one process
    trainer = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=per_token_logps_and_entropies,
        top_entropy_quantile=top_entropy_quantile, off_policy_mask_threshold=None, importance_sampling_level=level, beta=beta,
        args=args, loss_type=loss_type, epsilon_low=0.2, epsilon_high=1.1 if loss_type == "cispo" else 0.28,
        use_vllm=is_ratio is not None, vllm_importance_sampling_correction=is_ratio is not None,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=GA,
        accelerator=types.SimpleNamespace(
            num_processes=1, gather=identity, reduce=identity, gather_for_metrics=identity, sync_gradients=False,
            pad_across_processes=identity,
        ),
        _metrics={"train": defaultdict(list)}, _entropy_bonus_enabled=entropy_coef != 0.0, entropy_coef=entropy_coef,
        use_adaptive_entropy=False, aux_loss_enabled=False, max_completion_length=MAX_LEN, temperature=TEMPERATURE,
        get_gamma_weights=GRPOTrainer.get_gamma_weights, get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
    )
    trainer.get_high_entropy_mask = functools.partial(GRPOTrainer.get_high_entropy_mask, trainer)
    return trainer


SETTINGS = {
    "plain": dict(beta=0.0, level="token", delta=None, entropy_coef=0.0, vllm_is=False),
    "kl_delta_is": dict(beta=0.04, level="token", delta=2.0, entropy_coef=0.0, vllm_is=True),
    "sequence_entropy": dict(beta=0.04, level="sequence", delta=None, entropy_coef=0.01, vllm_is=False),
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
def test_matches_trl_compute_loss(loss_type, setting):
    s = dict(SETTINGS[setting])
    vllm_is = s.pop("vllm_is")
    if loss_type == "vespo" and s["level"] == "sequence":
        pytest.skip("TRL's VESPO expects importance_sampling_level='token'")
    case = make_case(bias=False, seed=21)
    mask = case["mask"]
    is_ratio = torch.where(mask > 0, case["is_weights"], torch.ones_like(mask)) if vllm_is else None
    B, T = mask.shape

    hidden = case["hidden"].clone().requires_grad_()
    weight = case["weight"].clone().requires_grad_()
    trainer = _fake_trainer(loss_type, hidden, weight, is_ratio=is_ratio, **s)
    inputs = {
        "prompt_ids": torch.zeros(B, 0, dtype=torch.long), "prompt_mask": torch.zeros(B, 0, dtype=torch.long),
        "completion_ids": case["labels"], "completion_mask": mask.long(), "advantages": case["advantages"],
        "old_per_token_logps": case["old_logps"], "ref_per_token_logps": case["ref_logps"],
        "num_items_in_batch": torch.tensor(NUM_ITEMS),
    }
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    trl_loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    trl_loss.backward()
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    options = loss_options(trainer, inputs, torch.arange(B))
    h2 = case["hidden"].clone().requires_grad_()
    w2 = case["weight"].clone().requires_grad_()
    loss, metrics = tiled_grpo_loss(h2, w2, case["labels"], case["advantages"], mask, tile_size=4, **options)
    loss.backward()

    assert max_rel(loss.detach(), trl_loss.detach()) <= 1e-5
    assert max_rel(h2.grad, hidden.grad) <= 1e-5
    assert max_rel(w2.grad, weight.grad) <= 1e-5
    assert metrics["entropy_mean"].item() == pytest.approx(logged["entropy"], rel=1e-5, abs=1e-7)
    if s["beta"]:
        assert metrics["kl_mean"].item() == pytest.approx(logged["kl"], rel=1e-5, abs=1e-7)
    if s["level"] == "token":  # TRL counts rows, not tokens, for sequence-level clip metrics
        if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            for ours, theirs in (("clip_frac_low", "low_mean"), ("clip_frac_high", "high_mean"),
                                 ("clip_frac", "region_mean")):
                assert metrics[ours].item() == pytest.approx(logged[f"clip_ratio/{theirs}"], abs=1e-6)
        if loss_type == "cispo":
            assert metrics["clip_frac_high"].item() == pytest.approx(logged["cispo_clip_ratio"], abs=1e-6)


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
def test_entropy_mask_matches_trl_compute_loss(loss_type, entropy_coef):
    """top_entropy_quantile < 1: the adapter's recipe (tiled_token_stats -> TRL's own get_high_entropy_mask ->
    policy_token_mask / entropy_token_mask) gives TRL's loss and gradients."""
    quantile = 0.6  # threshold at position 0.4 * (n - 1) of the sorted entropies: between two tokens
    case = make_case(bias=False, seed=23)
    mask = case["mask"]
    settings = dict(beta=0.04, level="token", delta=None, entropy_coef=entropy_coef)
    hidden = case["hidden"].clone().requires_grad_()
    weight = case["weight"].clone().requires_grad_()
    trainer = _fake_trainer(loss_type, hidden, weight, is_ratio=None, top_entropy_quantile=quantile, **settings)
    B, T = mask.shape
    inputs = {
        "prompt_ids": torch.zeros(B, 0, dtype=torch.long), "prompt_mask": torch.zeros(B, 0, dtype=torch.long),
        "completion_ids": case["labels"], "completion_mask": mask.long(), "advantages": case["advantages"],
        "old_per_token_logps": case["old_logps"], "ref_per_token_logps": case["ref_logps"],
        "num_items_in_batch": torch.tensor(NUM_ITEMS),
    }
    trl_loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    trl_loss.backward()
    with torch.no_grad():
        _, trl_entropies, _ = trainer._get_per_token_logps_and_entropies(None, case["labels"], mask, T)
    trl_mask = trainer.get_high_entropy_mask(trl_entropies, mask.long(), 1 - quantile)

    # the adapter: entropies from the tiled pass, TRL's own function for the mask
    _, entropies = tiled_token_stats(case["hidden"], case["weight"], case["labels"], mask, temperature=TEMPERATURE)
    entropy_mask = trainer.get_high_entropy_mask(entropies, mask.long(), 1 - quantile)
    assert torch.equal(entropy_mask, trl_mask) and 0 < entropy_mask.sum() < mask.sum()
    options = loss_options(trainer, inputs, torch.arange(B))
    if entropy_coef:  # TRL's bonus: a mean over mask * entropy_mask
        options["entropy_token_mask"] = entropy_mask
        options["entropy_normalizer"] = float((mask * entropy_mask).sum().clamp(min=1.0)) * GA
    h2 = case["hidden"].clone().requires_grad_()
    w2 = case["weight"].clone().requires_grad_()
    loss, _ = tiled_grpo_loss(h2, w2, case["labels"], case["advantages"], mask, policy_token_mask=entropy_mask,
                              tile_size=4, **options)
    loss.backward()
    assert max_rel(loss.detach(), trl_loss.detach()) <= 1e-5
    assert max_rel(h2.grad, hidden.grad) <= 1e-5
    assert max_rel(w2.grad, weight.grad) <= 1e-5
