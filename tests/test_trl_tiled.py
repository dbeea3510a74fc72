"""Tiled lm-head loss in TRL's GRPOTrainer: the loss from hidden states, TRL's result.

Besides the loss types: models whose loss path is not plain ``lm_head(hidden)`` (Gemma-2's
logit softcap, Cohere-2's logit scale, a MoE router aux loss; :mod:`tests.helpers.tiny_variants`) and
TRL's high-entropy token mask (``top_entropy_quantile < 1``), all against TRL's own path.

Runs the tiny model for 3 SGD steps with ``tiled_loss=True`` (recompute / logprob_skip /
filter off unless stated) against upstream TRL. The tiled loss computes the lm-head in fp32
tiles instead of TRL's chunked log-prob kernel, so sums run in another order: losses, grad
norms and the metrics TRL logs (entropy, clip ratios, KL, cispo / vespo metrics) agree to
1e-5 relative, weights to 1e-6 absolute (SGD: see test_trl_filter for why not Adam). A wrong
normaliser or objective moves the weights by ~1e-2. bf16=False: TRL's default bf16 autocast
runs its own lm-head in bf16 on CPU, which differs from an fp32 head by ~1e-3 in log-probs.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("trl")

from packaging.version import Version  # noqa: E402

from grpo_patches.demo import tiny_model  # noqa: E402
from grpo_patches.errors import IncompatibleOptionsError, UnsupportedFrameworkError  # noqa: E402
from tests.helpers.trl_runs import EXACT_METRICS, assert_close_or_none, assert_same_metrics, needs_tiled  # noqa: E402
from tests.helpers.trl_runs import run as upstream_or_filter_run  # noqa: E402
from tests.helpers import tiny_variants  # noqa: E402
from grpo_patches_testing.trl_train import require_loss_type, train  # noqa: E402

BASE = dict(recompute=False, logprob_skip=False, zero_advantage_filter=False)
COMMON = dict(steps=3, reward_funcs=tiny_model.reward_constant_per_prompt, bf16=False, optim="sgd")


@functools.lru_cache(maxsize=None)
def run(patched: bool, filter_on: bool = False, variant: str | None = None, tiled: object = True, **config: object):
    model = {} if variant is None else {"model_path": tiny_variants.model_path(variant)}
    if not patched:
        if variant is None:  # the upstream runs are the filter tests' (same config): share the cache
            return upstream_or_filter_run(False, **config)
        return train(False, None, **COMMON, **model, **config)
    return train(True, dict(BASE, tiled_loss=tiled, zero_advantage_filter=filter_on), **COMMON, **model, **config)


@needs_tiled
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "cispo"])
def test_tiled_loss_matches_trl(loss_type):
    require_loss_type(loss_type)
    ref, got = run(False, loss_type=loss_type), run(True, loss_type=loss_type)
    assert got.status["targets"] and any(t.endswith("GRPOTrainer.compute_loss") for t in got.status["targets"])
    assert ref.max_weight_diff(got) < 1e-6
    assert_same_metrics(ref, got)


@needs_tiled
def test_tiled_loss_with_kl_and_sequence_level_ratio():
    config = dict(loss_type="grpo", beta=0.04, importance_sampling_level="sequence")
    ref, got = run(False, **config), run(True, **config)
    assert ref.metrics("kl") and ref.max_weight_diff(got) < 1e-6
    assert_same_metrics(ref, got)


@needs_tiled
@pytest.mark.parametrize("loss_type", ["bnpo", "vespo"])
def test_tiled_loss_with_zero_advantage_filter(loss_type):
    require_loss_type(loss_type)
    ref, got = run(False, loss_type=loss_type), run(True, True, loss_type=loss_type)
    assert got.savings["rows_dropped"] > 0 and got.savings["forward_rows_skipped"] == got.savings["rows_dropped"]
    assert ref.max_weight_diff(got) < 1e-6
    assert_same_metrics(ref, got, names=EXACT_METRICS)
    assert_close_or_none(ref.extra["spy"].kept_rows("entropy"), got.metrics("entropy/kept_rows"))


@needs_tiled
@pytest.mark.parametrize("config", [dict(top_entropy_quantile=0.5),
                                    dict(top_entropy_quantile=0.5, entropy_coef=0.05, loss_type="grpo")])
def test_tiled_loss_with_the_high_entropy_mask(config):
    """The mask comes from a no-grad tiled pass and TRL's own quantile (the entropy bonus then
    averages over the masked tokens only, as TRL does)."""
    config = dict(config)
    ref, got = run(False, **config), run(True, **config)
    assert got.notes()["tiled_loss"].startswith("on")
    assert ref.max_weight_diff(got) < 1e-6
    assert_same_metrics(ref, got)


@needs_tiled
@pytest.mark.parametrize("variant", ["gemma2", "cohere2", "qwen2_moe"])
def test_tiled_loss_for_models_with_their_own_loss_path(variant):
    """Gemma-2's softcap and Cohere-2's logit scale in every tile; the MoE aux loss from the
    model itself, added by TRL (the filter is off for it: the aux loss involves every row)."""
    filter_on = "auto" if variant == "qwen2_moe" else False  # auto: must switch itself off for the MoE
    ref, got = run(False, variant=variant), run(True, filter_on, variant=variant)
    assert got.notes()["tiled_loss"].startswith("on")
    assert ref.max_weight_diff(got) < 1e-6
    assert_same_metrics(ref, got, names=(*EXACT_METRICS, "entropy", "aux_loss"))
    if variant == "qwen2_moe":
        assert ref.metrics("aux_loss") and got.notes()["zero_advantage_filter"].startswith("off")


def test_loss_records_branch_on_version():
    from grpo_patches.adapters.trl import ADAPTER
    from grpo_patches.options import Options

    for version, routing in (("1.16.0", "get_per_token_logps_and_entropies_v1_7"), ("0.20.0", "get_per_token_logps_and_entropies")):
        records = {t.attribute: t for t in ADAPTER.targets(Version(version))}
        assert records["GRPOTrainer._get_per_token_logps_and_entropies"].wrapper.endswith(routing)
        assert records["GRPOTrainer._compute_loss"].option == "zero_advantage_filter"
        tiled = [t for t in ADAPTER.targets(Version(version)) if t.option == "tiled_loss"]
        assert [t.attribute for t in tiled] == (["GRPOTrainer.compute_loss"] if version == "1.16.0" else [])
    with pytest.raises(UnsupportedFrameworkError, match=r"trl 0.20.0: tiled_loss needs trl >=1.16"):
        ADAPTER.select(Version("0.20.0"), Options(tiled_loss=True))
