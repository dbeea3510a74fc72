"""The NeMo-RL adapter against the real ``ClippedPGLossFn`` and patch targets of the tag on the path.

No Automodel needed: these run on every tag. The worker tests are ``test_real_worker.py``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest
import torch

import grpo_patches
from grpo_patches import registry
from grpo_patches.plugins import hook
from grpo_patches_testing import nemo_rl_cpu as harness
from tests.helpers.nemo_fake import READS_AS
from tests.helpers.nemo_worker_harness import batched, make_batch, make_loss, rel

TAG = harness.setup()
TOL = 1e-6
NEW = TAG != "v0.5.0"


@pytest.fixture(autouse=True)
def _clean():
    yield
    grpo_patches.disable()


def _loss(loss_fn, logits, data, gvs, gvt):
    """Call the real loss the way the tag's worker does."""
    if TAG == "v0.5.0":
        return loss_fn(logits, data, gvs, gvt)
    from nemo_rl.algorithms.loss import prepare_loss_input

    loss_input, data = prepare_loss_input(logits, data, loss_fn)
    return loss_fn(data=data, global_valid_seqs=gvs, global_valid_toks=gvt, **loss_input)


def _counts(data):
    return data["sample_mask"].sum(), (data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)).sum()


def test_the_version_is_read_from_this_source():
    expected = os.environ.get(harness.TAG_ENV)
    if not expected:
        pytest.skip(f"{harness.TAG_ENV} not set (the compat cell sets it)")
    entry = grpo_patches.status()["nemo_rl"]
    assert entry["installed"] == READS_AS[expected] and entry["supported"], entry


def _megatron_installed() -> bool:
    """Megatron is importable for real: not v0.6.0's stub (``harness.stub_megatron``, modules without a
    spec, which ``find_spec`` refuses with a ValueError) and not absent."""
    stub = sys.modules.get("megatron")
    if stub is not None and stub.__spec__ is None:
        return False
    return importlib.util.find_spec("megatron") is not None


def test_every_patch_record_resolves_on_this_source():
    grpo_patches.enable("nemo_rl", zero_advantage_filter=True, tiled_loss=NEW, verify_every=1 if NEW else None)
    adapter = registry.get("nemo_rl")
    modules = dict.fromkeys(t.module for t in adapter.targets(adapter.installed_version()))
    # the Megatron worker imports only beside Megatron-Bridge: its own cell (nemo_rl v0.7.0-megatron) resolves it
    elsewhere = () if _megatron_installed() else tuple(m for m in modules if "megatron" in m)
    for module in modules:
        if module in elsewhere:
            continue
        if "workers" in module or "automodel" in module:
            harness.need_worker()
        importlib.import_module(module)
    states = {r["target"]: r["state"] for r in grpo_patches.status()["nemo_rl"]["patches"]
              if r["target"].split(":")[0] not in elsewhere}
    assert set(states.values()) == {"applied"}, states


@pytest.mark.parametrize("overrides", [{}, {"token_level_loss": False}, {"ratio_clip_c": 3.0},
                                       {"use_importance_sampling_correction": True}],
                         ids=["token", "sequence", "dual-clip", "importance-sampling"])
def test_kept_rows_with_the_original_denominators_give_the_real_gradient(overrides, record_property):
    """The filter's premise, on the real loss: zero-advantage rows left out, the global counts kept."""
    from grpo_patches.adapters.nemo_rl.calls import loss_tensors
    from grpo_patches.adapters.nemo_rl.loss_modes import denominator

    data = batched(make_batch())
    loss_fn = make_loss(TAG, **overrides)
    torch.manual_seed(0)
    logits = torch.randn(12, 9, 23, requires_grad=True)
    gvs, gvt = _counts(data)
    full, _ = _loss(loss_fn, logits, data, gvs, gvt)
    (full_grad,) = torch.autograd.grad(full, logits)
    advantages, mask = loss_tensors(data)
    keep = hook().grpo_filter_zero_advantage(advantages=advantages, mask=mask, denominator=denominator(loss_fn),
                                             group=None).keep
    kept, _ = _loss(loss_fn, logits[keep], data.select_indices(keep), gvs, gvt)
    (kept_grad,) = torch.autograd.grad(kept, logits)
    diff = rel(kept_grad, full_grad)
    record_property("exact_loss_kept_rows_grad_rel", diff)
    assert diff <= TOL and float(kept) == pytest.approx(float(full), rel=TOL)
    assert len(keep) == 6  # the six zero-advantage rows are left out


def test_on_policy_prev_on_the_real_loss(record_property):
    """What the workers do when the driver skipped the prev pass equals a real pass on-policy."""
    from grpo_patches.adapters.nemo_rl.state import PREV_IS_CURRENT

    data = batched(make_batch())
    torch.manual_seed(0)
    logits = torch.randn(12, 9, 23, requires_grad=True)
    with torch.no_grad():
        current = torch.log_softmax(logits[:, :-1], -1).gather(-1, data["input_ids"][:, 1:, None]).squeeze(-1)
    real = batched(dict(make_batch(), prev_logprobs=torch.cat([torch.zeros(12, 1), current], dim=1)))
    gvs, gvt = _counts(data)
    loss_real, metrics_real = _loss(make_loss(TAG), logits, real, gvs, gvt)
    (grad_real,) = torch.autograd.grad(loss_real, logits)
    grpo_patches.enable("nemo_rl", zero_advantage_filter=False)
    importlib.import_module("nemo_rl.algorithms.loss_functions" if TAG == "v0.5.0"
                            else "nemo_rl.algorithms.loss.loss_functions")
    on_policy = make_loss(TAG)
    on_policy.force_on_policy_ratio = True
    setattr(on_policy, PREV_IS_CURRENT, True)
    zeros = batched(dict(make_batch(), prev_logprobs=torch.zeros(12, 9)))
    loss_skip, metrics_skip = _loss(on_policy, logits, zeros, gvs, gvt)
    (grad_skip,) = torch.autograd.grad(loss_skip, logits)
    diff = rel(grad_skip, grad_real)
    record_property("exact_loss_prev_skip_grad_rel", diff)
    assert diff <= TOL
    for key in ("token_mult_prob_error", "gen_kl_error", "sampling_importance_ratio", "probs_ratio"):
        assert metrics_skip[key] == pytest.approx(metrics_real[key], rel=1e-5), key


@pytest.mark.skipif(not NEW, reason="the tiled loss supports NeMo-RL >= 0.6.0")
@pytest.mark.parametrize("overrides,temperature", [({}, 1.0), ({"token_level_loss": False}, 1.0),
                                                   ({"ratio_clip_c": 3.0}, 1.0), ({}, 0.7)],
                         ids=["token", "sequence", "dual-clip", "temperature"])
def test_tiled_options_reproduce_the_real_loss(overrides, temperature, record_property):
    """The options the adapter gives ``grpo_lm_head_loss`` reproduce the real loss from the hidden
    state and lm-head weight (gradients w.r.t. both)."""
    from grpo_patches.adapters.nemo_rl.state import TiledMicrobatch
    from grpo_patches.adapters.nemo_rl.tiled import _loss_options

    data = batched(make_batch())
    loss_fn = make_loss(TAG, **overrides)
    torch.manual_seed(0)
    hidden = torch.randn(12, 9, 16, requires_grad=True)
    head = torch.nn.Linear(16, 23, bias=False)
    gvs, gvt = _counts(data)
    real, _ = _loss(loss_fn, head(hidden) / temperature, data, gvs, gvt)
    real_grads = torch.autograd.grad(real, (hidden, head.weight))
    micro = TiledMicrobatch(data=data, loss_fn=loss_fn, global_valid_seqs=gvs, global_valid_toks=gvt,
                            temperature=temperature)
    mask = data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
    tiled, _ = hook().grpo_lm_head_loss(hidden=hidden[:, :-1], weight=head.weight, labels=data["input_ids"][:, 1:],
                                        advantages=data["advantages"][:, 1:], mask=mask,
                                        options={**_loss_options(micro, head), "tile_size": 5})
    tiled_grads = torch.autograd.grad(tiled, (hidden, head.weight))
    diff = max(rel(t, r) for t, r in zip(tiled_grads, real_grads))
    record_property("exact_loss_tiled_grad_rel", diff)
    assert diff <= TOL and float(tiled) == pytest.approx(float(real), rel=TOL)
