"""Shared inputs and comparisons for the tiled-loss tests (tiny shapes: every case runs in ms)."""

from __future__ import annotations

import torch

from grpo_patches.adapters.trl.loss_modes import tiled_loss_preset
from grpo_patches.tiled_loss import dense_grpo_loss, tiled_grpo_loss

#: fp32 tolerance of the issue: max |a - b| / max |b| over each tensor
FP32_RTOL = 1e-5


def trl_loss(loss_type: str, **options):
    """The tiled loss's options for one of TRL's ``loss_type`` names (the TRL adapter's preset),
    with ``options`` on top: the TRL losses are the tests' shorthand for objective + aggregation."""
    return {**tiled_loss_preset(loss_type, options.get("epsilon_high", 0.2)), **options}


def make_case(B=3, T=7, H=16, V=37, dtype=torch.float32, seed=0, bias=True, per_token_adv=False):
    """Random hidden/weight/labels/advantages/mask with a fully masked row and a partial row."""
    g = torch.Generator().manual_seed(seed)
    case = {
        "hidden": torch.randn(B, T, H, generator=g).to(dtype),
        "weight": (torch.randn(V, H, generator=g) * 0.4).to(dtype),
        "labels": torch.randint(0, V, (B, T), generator=g),
        "advantages": torch.randn(B, T, generator=g) if per_token_adv else torch.randn(B, generator=g),
        "mask": (torch.rand(B, T, generator=g) > 0.25).float(),
        "bias": (torch.randn(V, generator=g) * 0.2).to(dtype) if bias else None,
    }
    if B > 1:
        case["mask"][1] = 0.0  # an all-masked row
    if B > 2:
        case["mask"][2, :2] = 1.0
    # old/ref log-probs near the current ones so that some ratios clip and some do not
    with torch.no_grad():
        _, met = dense_grpo_loss(
            case["hidden"].float(), case["weight"].float(), case["labels"], case["advantages"],
            torch.ones(B, T), bias=None if case["bias"] is None else case["bias"].float(), return_logps=True,
        )
    logps = met["logps"]
    case["old_logps"] = logps + 0.3 * torch.randn(B, T, generator=g)
    case["ref_logps"] = logps + 0.3 * torch.randn(B, T, generator=g)
    case["is_weights"] = torch.rand(B, T, generator=g) * 1.5 + 0.25
    case["sampling_logps"] = logps + 0.3 * torch.randn(B, T, generator=g)
    return case


def run(fn, case, k=1.0, **options):
    """Loss, metrics and the gradients of hidden / weight / bias after ``(loss * k).backward()``."""
    hidden = case["hidden"].clone().requires_grad_()
    weight = case["weight"].clone().requires_grad_()
    bias = None if case["bias"] is None else case["bias"].clone().requires_grad_()
    extra = {name: case[name] for name in ("old_logps", "ref_logps", "is_weights", "sampling_logps") if name in options}
    for name in extra:
        options.pop(name)
    loss, metrics = fn(hidden, weight, case["labels"], case["advantages"], case["mask"], bias=bias, **extra, **options)
    (loss * k).backward()
    grads = {"hidden": hidden.grad, "weight": weight.grad}
    if bias is not None:
        grads["bias"] = bias.grad
    return loss.detach(), metrics, grads


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff if scale == 0 else diff / scale


def assert_close(tiled, dense, rtol=FP32_RTOL, what=""):
    """Compare (loss, metrics, grads) triples: same metric names, every tensor within ``rtol``."""
    (l1, m1, g1), (l2, m2, g2) = tiled, dense
    assert torch.isfinite(l1).all(), what
    assert max_rel(l1, l2) <= rtol, f"{what} loss {l1} vs {l2}"
    assert set(m1) == set(m2), f"{what} metric names differ: {sorted(set(m1) ^ set(m2))}"
    for name in m2:
        assert max_rel(m1[name], m2[name]) <= rtol, f"{what} metric {name}: {m1[name]} vs {m2[name]}"
    assert set(g1) == set(g2)
    for name in g2:
        assert g1[name] is not None and g1[name].dtype == g2[name].dtype, f"{what} grad {name}"
        assert max_rel(g1[name], g2[name]) <= rtol, f"{what} grad {name}: {max_rel(g1[name], g2[name])}"


def compare(case, rtol=FP32_RTOL, **options):
    tiled = run(tiled_grpo_loss, case, **options)
    dense = run(dense_grpo_loss, case, **options)
    assert_close(tiled, dense, rtol, what=str(options))
    return tiled, dense


def policy_case(seed, temperature, B=4, T=64, H=64, V=1024, dtype=torch.bfloat16):
    """GRPO-like low-precision inputs: logits of std ~2.5, labels sampled from the policy (confident
    labels, where ``onehot - p`` cancels); ``(hidden, weight, labels, advantages, mask)``."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 2.5 / H**0.5).to(dtype)
    probs = torch.softmax((hidden.double() @ weight.double().t()).reshape(-1, V) / temperature, -1)
    labels = torch.multinomial(probs.float(), 1, generator=g).reshape(B, T)
    return hidden, weight, labels, torch.randn(B, generator=g), (torch.rand(B, T, generator=g) > 0.1).float()


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in fp64."""
    return float((x.double() - ref).norm() / ref.norm())
