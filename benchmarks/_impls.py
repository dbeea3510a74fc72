"""The implementations the lm-head GRPO loss benchmark compares, behind one calling convention.

Every entry is ``build_<name>(opts) -> step`` where ``step(inputs) -> loss`` runs the forward pass
(``loss.backward()`` is the caller's). ``build_*`` imports lazily and raises ``Unavailable`` when the
package is missing or cannot run here, so the benchmark reports a row instead of failing.

All implementations compute the same objective: per-token log-prob of ``labels`` under
``softmax(hidden @ weight.T / temperature)``, the clipped GRPO ratio loss against ``old_logps``
(ε 0.2 both sides, no KL) and the token mean over unmasked tokens (DAPO-style).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

Inputs = dict[str, Any]
Step = Callable[[Inputs], torch.Tensor]

EPS_LOW = 0.2
EPS_HIGH = 0.2
TEMPERATURE = 1.0


class Unavailable(RuntimeError):
    """The implementation's package is missing or cannot run in this environment."""


def grpo_loss_from_logps(
    logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, denom: torch.Tensor
) -> torch.Tensor:
    """Clipped-ratio GRPO loss summed over ``mask`` and divided by ``denom`` (all [n] tensors, fp32 math)."""
    ratio = torch.exp(logps.float() - old_logps)
    clipped = ratio.clamp(1.0 - EPS_LOW, 1.0 + EPS_HIGH)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    return (per_token * mask).sum() / denom


def dense_token_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probs of ``labels`` through the full [n, V] logits (fp32 softmax, as frameworks do)."""
    logits = (hidden @ weight.t()).float() / TEMPERATURE
    return logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _mask_f(inputs: Inputs) -> torch.Tensor:
    return inputs["mask"].to(torch.float32)


def build_dense(opts: dict) -> Step:
    """Materialize the logits, log_softmax, gather, GRPO loss: what a framework does without fusing."""

    def step(inputs: Inputs) -> torch.Tensor:
        mask = _mask_f(inputs)
        logps = dense_token_logps(inputs["hidden"], inputs["weight"], inputs["labels"])
        return grpo_loss_from_logps(logps, inputs["old_logps"], inputs["advantages"], mask, mask.sum().clamp(min=1))

    return step


def build_project(opts: dict) -> Step:
    """grpo_patches' tiled loss with its defaults (tile size from its memory budget unless --project-tile)."""
    try:
        from grpo_patches.tiled_loss import tiled_grpo_loss
    except ImportError as exc:
        raise Unavailable(f"not installed ({exc})") from exc
    kwargs = {}
    if opts.get("project_tile"):
        kwargs["tile_size"] = opts["project_tile"]
    if opts.get("project_tile_memory"):
        kwargs["tile_memory_bytes"] = opts["project_tile_memory"]

    def step(inputs: Inputs) -> torch.Tensor:
        loss, _metrics = tiled_grpo_loss(
            inputs["hidden"], inputs["weight"], inputs["labels"], inputs["advantages"], inputs["mask"],
            old_logps=inputs["old_logps"], temperature=TEMPERATURE, **kwargs,
        )
        return loss

    return step


def build_liger(opts: dict) -> Step:
    """Liger's LigerFusedLinearGRPOLoss (gradients computed chunk by chunk inside the forward pass)."""
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except Exception as exc:  # triton or CUDA-only imports fail with assorted errors on CPU
        raise Unavailable(f"not installed ({type(exc).__name__}: {exc})") from exc
    # Liger chunks over rows: chunk_size=1 row of T tokens per chunk (T = tokens / rows).
    loss_fn = LigerFusedLinearGRPOLoss(
        beta=0.0, use_ref_model=False, chunk_size=1, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
        loss_type="dapo", temperature=TEMPERATURE, compiled=bool(opts.get("liger_compiled", True)),
    )

    def step(inputs: Inputs) -> torch.Tensor:
        rows = inputs["rows"]
        hidden, labels = inputs["hidden"], inputs["labels"]
        # Advantages are per row in Liger; the benchmark's per-token advantages are row constants.
        row_adv = inputs["advantages"].view(rows, -1)[:, 0]
        loss, _metrics = loss_fn(
            hidden.view(rows, -1, hidden.shape[-1]), inputs["weight"], labels.view(rows, -1),
            inputs["mask"].view(rows, -1).to(torch.int64), row_adv,
            old_per_token_logps=inputs["old_logps"].view(rows, -1),
        )
        return loss

    return step


def _import_trl_chunked_logprob():
    try:
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction
        return ChunkedLogProbFunction
    except ImportError:
        pass
    try:
        from trl.kernels import ChunkedLogProbFunction
        return ChunkedLogProbFunction
    except ImportError as exc:
        raise Unavailable(f"not installed (trl without ChunkedLogProbFunction, needs trl>=1.15: {exc})") from exc


def build_trl(opts: dict) -> Step:
    """TRL 1.15+'s chunked log-prob path (recomputes tiles in backward), then the GRPO loss densely on [N]."""
    fn = _import_trl_chunked_logprob()
    try:
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as vocab_chunk  # what GRPOTrainer uses
    except ImportError:
        vocab_chunk = 32768

    def step(inputs: Inputs) -> torch.Tensor:
        mask = _mask_f(inputs)
        # outputs=(): log-probs only (GRPOTrainer also asks for entropy, a metric; left out for parity).
        logps = fn.apply(inputs["hidden"], inputs["weight"], None, inputs["labels"], TEMPERATURE, vocab_chunk,
                         None, 1.0, ())[0]
        return grpo_loss_from_logps(logps, inputs["old_logps"], inputs["advantages"], mask, mask.sum().clamp(min=1))

    return step


class _LmHead:
    """The ``self`` DeepSpeed passes back to the per-shard loss function."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight


def build_deepspeed(opts: dict) -> Step:
    """DeepSpeed's TiledFusedLogitsLoss: per-shard dense loss, fwd+bwd of each shard inside the forward."""
    try:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss
    except Exception as exc:
        raise Unavailable(f"not installed ({type(exc).__name__}: {exc})") from exc
    tile = int(opts["tile"])

    def step(inputs: Inputs) -> torch.Tensor:
        hidden, weight = inputs["hidden"], inputs["weight"]
        n = hidden.shape[0]
        mask = _mask_f(inputs)
        denom = mask.sum().clamp(min=1)
        # y carries labels, advantages and old log-probs so DeepSpeed shards them together (fp32: exact ids).
        y = torch.stack([inputs["labels"].float(), inputs["advantages"], inputs["old_logps"]], -1).view(1, n, 3)

        def shard_loss(head: _LmHead, x: torch.Tensor, y_shard: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            x, y_shard, m = x.reshape(-1, x.shape[-1]), y_shard.reshape(-1, 3), m.reshape(-1)
            logps = dense_token_logps(x, head.weight, y_shard[:, 0].long())
            return grpo_loss_from_logps(logps, y_shard[:, 2], y_shard[:, 1], m, denom)

        shards = max(1, -(-n // tile))
        return TiledFusedLogitsLoss.apply(
            shard_loss, _LmHead(weight), hidden.view(1, n, -1), y, mask.view(1, n), shards, [weight], "sum"
        )

    return step


BUILDERS: dict[str, Callable[[dict], Step]] = {
    "dense": build_dense,
    "project": build_project,
    "baseline": build_project,  # the same call, grpo_patches imported from --baseline-src
    "liger": build_liger,
    "trl": build_trl,
    "deepspeed": build_deepspeed,
}
PEERS = ("liger", "trl", "deepspeed")
