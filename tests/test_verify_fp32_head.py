"""The fp32-head reference of verify mode in half precision (grpo_patches/verify_fp32_head.py):
the head's swap and its undoing, the count that tells a reference from a run that never called
the head, and the tolerance rule (never stricter than the comparison without the reference)."""

from __future__ import annotations

import torch

from grpo_patches import verify
from grpo_patches import verify_fp32_head as fp32_head


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, 16)
        self.lm_head = torch.nn.Linear(16, 50, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.body(x))


def test_the_head_computes_in_fp32_and_its_gradients_flow_back_in_bf16():
    model = TinyLM().to(torch.bfloat16)
    x = torch.randn(4, 8, dtype=torch.bfloat16) * 8
    half = model(x)
    with fp32_head.fp32_head(model) as calls:
        full = model(x)
        assert fp32_head.REFERENCE.current() is calls
    assert calls.count == 1 and half.dtype == torch.bfloat16 and full.dtype == torch.float32
    exact = model.body(x).float() @ model.lm_head.weight.float().t()
    assert torch.equal(full, exact) and not torch.equal(full, half.float())  # bf16 logits round; these do not
    full.sum().backward()
    assert model.lm_head.weight.grad.dtype == torch.bfloat16 and model.body.weight.grad.dtype == torch.bfloat16
    assert "forward" not in vars(model.lm_head) and fp32_head.REFERENCE.current() is None  # put back


def test_a_head_never_called_counts_zero_and_an_already_swapped_one_is_left_alone():
    model = TinyLM()
    with fp32_head.fp32_head(model) as calls:
        model.body(torch.randn(2, 8))
        assert not fp32_head.tiled_aside()
    assert calls.count == 0  # no reference: the framework took the weight itself
    with fp32_head.fp32_head(model, tiled_aside=True):  # the patched computation, its tiled loss stepping aside
        assert fp32_head.tiled_aside()
    assert not fp32_head.tiled_aside()

    def own(hidden):
        return hidden

    model.lm_head.forward = own
    with fp32_head.fp32_head(model) as calls:
        assert model.lm_head.forward is own
    assert model.lm_head.forward is own


def test_a_fused_kernel_gets_fp32_inputs_only_within_the_reference():
    seen = []

    def kernel(hidden, weight, bias=None, scale=1.0):
        seen.append((hidden.dtype, weight.dtype, bias, torch.is_autocast_enabled("cpu")))
        return hidden

    a, b = torch.ones(2, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fp32_head.kernel_call(kernel, (a, b), {}, "hidden", "weight", "bias")
        with fp32_head.fp32_head(TinyLM()) as calls:
            fp32_head.kernel_call(kernel, (a,), {"weight": b, "scale": 2.0}, "hidden", "weight", "bias")
    assert seen == [(torch.bfloat16, torch.bfloat16, None, True), (torch.float32, torch.float32, None, False)]
    assert calls.count == 1 and fp32_head.fp32(a) is None  # outside the reference: nothing


def test_the_tolerance_is_never_stricter_than_without_the_reference():
    bf16 = torch.bfloat16
    without = verify.tolerance("fakefw", bf16, 1e-3)  # 10 x the re-batched floor
    assert fp32_head.tolerance("fakefw", bf16, 1e-4, 1e-3) == without
    assert fp32_head.tolerance("fakefw", bf16, 0.05, 1e-3) == verify.REFERENCE_FACTOR * 0.05
    assert fp32_head.tolerance("fakefw", bf16, 0.0, None) == verify.tolerance("fakefw", bf16)  # 10 x epsilon
