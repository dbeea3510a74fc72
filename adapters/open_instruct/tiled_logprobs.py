"""Per-token log-probs from hidden states and the lm-head weight, tile by tile, differentiable.

open-instruct's loss reads per-token log-probs, not logits: everything it does after
``forward_for_logprobs`` (ratio, dapo / cispo, rho weights, the KL estimators, the denominators)
is its own code on a ``[B, T]`` tensor. So the tiled lm-head answers that tensor: the forward is
the ``grpo_lm_head_token_stats`` hook (default :func:`grpo_patches.tiled_token_stats`: log-prob and
entropy per token, one ``[tile, vocab]`` block at a time), and the backward, given
``g = dLoss/dlogps``, is the ``grpo_lm_head_loss`` hook (default :func:`grpo_patches.tiled_grpo_loss`)
asked for ``sum(g * logps)``: CISPO's on-policy token loss ``-A * stopgrad(ratio) * logps`` with
``A = -g``, ratio 1, summed. Neither ever holds ``[tokens, vocab]`` logits; the backward
recomputes each tile's logits (one GEMM more than the dense path, which keeps them).

Under DeepSpeed ZeRO-3 this runs inside the output layer's forward (:mod:`.lm_heads`): the
weight is gathered there, and DeepSpeed gathers it again before this function's backward runs
(its pre-backward hook sits on the layer's output); otherwise the backward gathers it itself.
Only tokens with a non-zero incoming gradient are recomputed (the rest add exactly nothing).
"""

from __future__ import annotations

from typing import Any

import torch

from grpo_patches.plugins import hook
from grpo_patches.tiled_loss.zero3 import gathered_weight


def _options(temperature: float, tile_size: int | None, bias: Any) -> dict[str, Any]:
    options: dict[str, Any] = {"temperature": temperature, "bias": bias}
    if tile_size is not None:
        options["tile_size"] = tile_size
    return options


def token_stats(hidden: Any, weight: Any, bias: Any, labels: Any, mask: Any, temperature: float,
                tile_size: int | None) -> tuple[Any, Any]:
    """``(logps, entropy)``, ``labels``' shape, fp32, no gradient (0 where ``mask`` is False)."""
    answer = hook().grpo_lm_head_token_stats(hidden=hidden, weight=weight, labels=labels, mask=mask,
                                             options=_options(temperature, tile_size, bias))
    if answer is None:
        raise RuntimeError("grpo_patches: every grpo_lm_head_token_stats implementation deferred; the tiled "
                           "forward needs one (the default is grpo_patches.tiled_token_stats)")
    return answer


class TiledLogprobs(torch.autograd.Function):
    """``logps[b, t] = log softmax(hidden[b, t] @ weight.T + bias)[labels[b, t]]`` at ``temperature``."""

    @staticmethod
    def forward(ctx: Any, hidden: Any, weight: Any, bias: Any, labels: Any, mask: Any, temperature: float,
                tile_size: int | None, out: Any) -> Any:
        logps, entropy = token_stats(hidden, weight, bias, labels, mask, temperature, tile_size)
        if getattr(out, "verify_group", None) is not None:  # verify mode: against open-instruct's dense computation
            from . import verify_tiled

            logps, entropy = verify_tiled.forward(out, hidden, weight, bias, logps, entropy)
        out.entropy = entropy
        ctx.save_for_backward(hidden, labels, mask)
        ctx.weight, ctx.bias, ctx.temperature, ctx.tile_size, ctx.out = weight, bias, temperature, tile_size, out
        return logps.to(torch.result_type(hidden, weight))

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple:
        hidden, labels, mask = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        active = mask & (grad != 0)
        with gathered_weight(weight, bias), torch.enable_grad():
            h = hidden.detach().requires_grad_(True)
            w = weight.detach().requires_grad_(True)
            b = bias.detach().requires_grad_(True) if bias is not None else None
            wanted = [t for t in (h, w, b) if t is not None]
            if not bool(active.any()):
                grads = [torch.zeros_like(t) for t in wanted]
            else:
                options = {**_options(ctx.temperature, ctx.tile_size, b), "objective": "cispo",
                           "cispo_max_ratio": float("inf"), "aggregation": "token-sum"}
                answer = hook().grpo_lm_head_loss(hidden=h, weight=w, labels=labels, advantages=-grad.float(),
                                                  mask=active, options=options)
                if answer is None:
                    raise RuntimeError("grpo_patches: every grpo_lm_head_loss implementation deferred; the tiled "
                                       "backward needs one (the default is grpo_patches.tiled_grpo_loss)")
                grads = list(torch.autograd.grad(answer[0], wanted, allow_unused=True))
                grads = [torch.zeros_like(t) if g is None else g for t, g in zip(wanted, grads)]
            if getattr(ctx.out, "verify_group", None) is not None:
                from . import verify_tiled

                grads = verify_tiled.backward(ctx.out, h, w, b, grad, grads)
        grad_h, grad_w = grads[0].to(hidden.dtype), grads[1].to(weight.dtype)
        grad_b = grads[2].to(bias.dtype) if bias is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None


def tiled_logprobs(hidden: Any, weight: Any, bias: Any, labels: Any, mask: Any, temperature: float,
                   tile_size: int | None, out: Any) -> Any:
    """:class:`TiledLogprobs` (``out.entropy`` receives the detached entropies)."""
    return TiledLogprobs.apply(hidden, weight, bias, labels, mask, temperature, tile_size, out)
