"""The three GEMMs of a tile (logits, grad hidden, grad weight) for every input dtype.

fp32 / fp64 inputs run as given. bf16 / fp16 inputs run every GEMM on their exact values with
fp32 accumulation *and an fp32 result*, so only the returned gradients are rounded to the input
dtype: rounding the logits before the softmax, or each tile's weight-gradient product before
summing the tiles, is what made the low-precision gradient less accurate than dense autograd.
Two ways to get there:

- ``"upcast"`` (CPU and any device without fp32-output bf16 GEMMs): the operands are upcast to
  fp32 (the weight in blocks of rows, so no ``[V, H]`` fp32 copy ever exists) and the fp32 path
  runs unchanged. On a CPU without bf16 matrix instructions this is also several times faster
  than bf16 GEMMs.
- ``"fp32_out"`` (CUDA): bf16 GEMMs with fp32 results (``out_dtype``). The logits gradient is a
  GEMM operand there, so it is rounded once to the input dtype, with the one-hot term folded in
  first: rounding ``-g p`` alone and adding ``g onehot`` after the GEMM cancels catastrophically
  at confident labels (``p_y`` near 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

NATIVE, UPCAST, FP32_OUT = "native", "upcast", "fp32_out"
#: fp32 scratch per upcast weight block (rows = this / (4 H)): big enough for efficient GEMMs.
UPCAST_BLOCK_BYTES = 16 * 2**20


def without_autocast(device: torch.device):
    """The tile loop picks each GEMM's precision itself: an enclosing autocast (TRL, verl and NeMo
    run model code under one) would turn some of its matmuls into bf16 ones and not others."""
    return torch.autocast(device.type, enabled=False)


def gemm_mode(dtype: torch.dtype, device: torch.device) -> str:
    """How the tile GEMMs treat inputs of ``dtype`` on ``device`` (see the module docstring)."""
    if dtype in (torch.float32, torch.float64):
        return NATIVE
    if device.type == "cuda" and torch.__version__ >= (2, 8):  # torch.mm(..., out_dtype=torch.float32)
        return FP32_OUT
    return UPCAST


def mm_fp32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` accumulated and returned in fp32 (fp64 stays fp64): low-precision operands as they are.

    Off CUDA (tests) the same numbers come from upcast operands: bf16 products are exact in fp32.
    """
    if a.dtype in (torch.float32, torch.float64):
        return torch.mm(a, b, out=out)
    if a.device.type == "cuda":
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    return torch.mm(a.float(), b.float(), out=out)


def addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float) -> None:
    """``acc = beta * acc + a @ b`` for an fp32 (fp64) ``acc``; ``beta=0`` ignores what ``acc`` held."""
    if a.dtype in (torch.float32, torch.float64):
        acc.addmm_(a, b, beta=beta)
    elif a.device.type == "cuda":
        torch.addmm(acc, a, b, out_dtype=torch.float32, beta=beta, out=acc)
    else:
        acc.addmm_(a.float(), b.float(), beta=beta)


@dataclass
class LmHead:
    """The lm-head weight (and bias) as the tile GEMMs read them."""

    weight: torch.Tensor  # [V, H], the caller's dtype
    bias_acc: torch.Tensor | None  # [V] in the accumulation dtype
    acc: torch.dtype
    mode: str

    @classmethod
    def for_inputs(cls, weight: torch.Tensor, bias: torch.Tensor | None, acc: torch.dtype) -> "LmHead":
        bias_acc = None if bias is None else bias.detach().to(acc)
        return cls(weight, bias_acc, acc, gemm_mode(weight.dtype, weight.device))

    @property
    def rounds_logit_grad(self) -> bool:
        """True when the logits gradient is rounded to the input dtype before the GEMMs."""
        return self.mode == FP32_OUT

    def blocks(self) -> Iterator[tuple[slice, torch.Tensor]]:
        """``(vocab rows, weight rows in the accumulation dtype)``: the whole weight when it already is."""
        vocab = self.weight.shape[0]
        if self.mode == NATIVE:
            yield slice(0, vocab), self.weight
            return
        rows = max(256, UPCAST_BLOCK_BYTES // (4 * self.weight.shape[1]))
        for start in range(0, vocab, rows):
            sl = slice(start, min(start + rows, vocab))
            yield sl, self.weight[sl].to(self.acc)

    def logits(self, out: torch.Tensor, hidden: torch.Tensor, alpha: float) -> None:
        """``out[:] = alpha * (hidden @ weight.T + bias)`` in ``out``'s dtype, never rounded to the input dtype."""
        if self.mode == FP32_OUT:
            mm_fp32(hidden, self.weight.t(), out=out)
            if self.bias_acc is not None:
                out.add_(self.bias_acc)
            if alpha != 1.0:
                out.mul_(alpha)
            return
        h = hidden.to(self.acc)
        for sl, w in self.blocks():
            if self.bias_acc is None:
                torch.addmm(out[:, sl], h, w.t(), beta=0, alpha=alpha, out=out[:, sl])
            else:
                torch.addmm(self.bias_acc[sl], h, w.t(), beta=alpha, alpha=alpha, out=out[:, sl])

    def grad_hidden(self, dense: torch.Tensor, dense_lp: torch.Tensor | None) -> torch.Tensor:
        """``dense @ weight`` ([n, H], accumulation dtype); ``dense_lp``: its rounded copy (``fp32_out``)."""
        if dense_lp is not None:
            return mm_fp32(dense_lp, self.weight)
        out = None
        for sl, w in self.blocks():
            part = dense[:, sl] @ w
            out = part if out is None else out.add_(part)
        return out

    def grad_weight_(
        self, acc: torch.Tensor, dense: torch.Tensor, dense_lp: torch.Tensor | None, hidden: torch.Tensor, first: bool
    ) -> None:
        """``acc (+)= dense.T @ hidden`` (``first`` overwrites); ``hidden`` in the accumulation dtype,
        except with ``dense_lp`` where it is the input-dtype tile."""
        if dense_lp is not None:
            addmm_fp32_(acc, dense_lp.t(), hidden, beta=0 if first else 1)
        else:
            acc.addmm_(dense.t(), hidden, beta=0 if first else 1)
