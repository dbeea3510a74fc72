"""The Megatron cells' tier logic (tests/helpers/megatron_tier.py) on a CPU: the flags, the two-GPU skip,
and the noise-floor tolerance the gpu tier compares bf16 gradients with (checked here on bf16 tensors:
re-batching moves a bf16 gradient, an exact filter stays inside twice that, a renormalising one does not)."""

from __future__ import annotations

import importlib

import pytest
import torch

from tests.helpers import megatron_tier


@pytest.fixture()
def reload_tier(monkeypatch):
    """The module re-read under the environment the test sets (and re-read once more afterwards)."""
    def reload(**env: str) -> object:
        for name in ("GRPO_PATCHES_TIER", "GRPO_PATCHES_MEGATRON_BF16"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return importlib.reload(megatron_tier)

    yield reload
    monkeypatch.undo()
    importlib.reload(megatron_tier)


def test_tolerance_is_fp32s_or_twice_the_noise():
    assert megatron_tier.tolerance() == megatron_tier.FP32_TOL == 1e-6
    assert megatron_tier.tolerance(1e-9) == 1e-6
    assert megatron_tier.tolerance(3e-3) == 6e-3


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA decides")
def test_without_cuda_every_tier_runs_fp32_on_cpu(reload_tier):
    for tier in ("cpu", "gpu"):
        tier_module = reload_tier(GRPO_PATCHES_TIER=tier)
        assert not tier_module.GPU and not tier_module.BF16 and not tier_module.use_te()
        tier_module.skip_unless_gpus(2)  # the cpu tier runs two processes on gloo: no skip
    assert reload_tier(GRPO_PATCHES_MEGATRON_BF16="1").BF16  # the bf16 comparisons on a CPU, on request


def _bf16_grad(x: torch.Tensor, adv: torch.Tensor, chunks: list[torch.Tensor], denominator: float) -> torch.Tensor:
    """A bf16 layer's gradient of sum(adv * |y|^2) / denominator, accumulated over ``chunks`` of rows."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(x.shape[1], 8).bfloat16()
    for rows in chunks:
        loss = (layer(x[rows]).float().pow(2).sum(-1) * adv[rows]).sum() / denominator
        loss.backward()
    return layer.weight.grad.double()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_noise_floor_accepts_an_exact_filter_and_refuses_a_renormalising_one():
    torch.manual_seed(1)
    x = torch.randn(12, 64).bfloat16()
    adv = torch.randn(12)
    adv[[1, 2, 5, 6, 8, 9]] = 0.0
    everything, kept = torch.arange(12), torch.nonzero(adv).flatten()
    ref = _bf16_grad(x, adv, list(everything.split(4)), 12)
    noise = _rel(_bf16_grad(x, adv, list(everything.split(6)), 12), ref)  # the same rows, re-batched
    exact = _bf16_grad(x, adv, list(kept.split(4)), 12)  # zero-advantage rows dropped, same denominator
    renormalised = _bf16_grad(x, adv, list(kept.split(4)), len(kept))
    assert noise > megatron_tier.FP32_TOL  # bf16: re-batching alone moves the gradient
    assert _rel(exact, ref) <= megatron_tier.tolerance(noise)
    assert _rel(renormalised, ref) > 10 * megatron_tier.tolerance(noise)
