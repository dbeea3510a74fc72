"""bf16 accuracy of the lm-head GRPO loss gradients: tiled vs dense vs TRL's chunked head, against fp64.

Every implementation sees the same bf16-rounded hidden states and lm-head weight; the reference is
the dense loss in fp64 on those values (upcast). Reported: relative L2 error
``||grad - ref|| / ||ref||`` of the hidden and the weight gradient, and the fwd+bwd time.

    python benchmarks/bf16_grad_error.py                        # N/H/V 512/256/8192, 1024/512/16384, 2048/1024/32000
    python benchmarks/bf16_grad_error.py --sizes 512,256,8192 --repeats 1

Rows:
  bf16-floor     the fp64 reference gradient rounded to bf16 once (no bf16 gradient can beat it)
  dense-bf16     dense_grpo_loss on bf16 hidden/weight (bf16 GEMMs, fp32 softmax; autograd)
  tiled-bf16     tiled_grpo_loss on bf16 hidden/weight (what a bf16 model hands the loss)
  trl-autocast   TRL's ChunkedLogProbFunction under bf16 autocast on fp32 hidden/weight (GRPOConfig's
                 default: fp32 parameters, bf16=True), then the same objective on its log-probs
  trl-bf16       TRL's ChunkedLogProbFunction on bf16 hidden/weight (a bf16 model), same objective
  tiled-fp32     tiled_grpo_loss on the fp32 values (the adapter outside autocast / cast_lm_head_to_fp32)

On-policy (ratio 1, as TRL with num_iterations=1): no clip decision can flip between
implementations, so the error is the arithmetic's alone. Labels are sampled from the model's own distribution (as GRPO completions are), so the label
usually has a large probability: that is where ``onehot - p`` cancels.
"""

from __future__ import annotations

import argparse
import time

import torch

from grpo_patches.tiled_loss import dense_grpo_loss, tiled_grpo_loss
from grpo_patches.tiled_loss.aggregation import aggregate_dense
from grpo_patches.tiled_loss.objective import TokenInputs, token_objective
from grpo_patches.tiled_loss.options import resolve_options

DEFAULT_SIZES = ("512,256,8192", "1024,512,16384", "2048,1024,32000")
ROWS = 8
OPTIONS = dict(objective="clip", aggregation="token-mean", temperature=0.9)  # TRL's default loss, dapo


def make_inputs(n: int, h: int, v: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).bfloat16().float()  # RMS-normed scale, bf16-valued
    weight = (torch.randn(v, h, generator=g) * (2.5 / h**0.5)).bfloat16().float()  # logit std ~2.5
    with torch.no_grad():
        logits = (hidden.double() @ weight.double().t()) / OPTIONS["temperature"]
        labels = torch.multinomial(torch.softmax(logits, -1).float(), 1, generator=g).squeeze(1)
    t = n // ROWS
    mask = (torch.arange(t)[None, :] < torch.randint(t // 2, t + 1, (ROWS, 1), generator=g)).float()
    return dict(
        hidden=hidden.reshape(ROWS, t, h), weight=weight, labels=labels.reshape(ROWS, t),
        advantages=torch.randn(ROWS, generator=g), mask=mask,
    )


def _grads(fn, hidden, weight, case) -> tuple[torch.Tensor, torch.Tensor, float]:
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    start = time.perf_counter()
    loss = fn(hidden, weight, case)
    loss.backward()
    return hidden.grad, weight.grad, time.perf_counter() - start


def _ours(loss_fn):
    def fn(hidden, weight, case):
        return loss_fn(hidden, weight, case["labels"], case["advantages"], case["mask"],
                       **OPTIONS)[0]
    return fn


def _trl(autocast: bool):
    """TRL's chunked log-prob head (as GRPOTrainer calls it), then the objective on its [N] log-probs."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    opts = resolve_options(**OPTIONS)

    def fn(hidden, weight, case):
        shape = case["labels"].shape
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logps = ChunkedLogProbFunction.apply(
                hidden.reshape(-1, hidden.shape[-1]), weight, None, case["labels"].reshape(-1),
                OPTIONS["temperature"], _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, (),
            )[0]
        row = torch.arange(shape[0]).repeat_interleave(shape[1])
        inputs = TokenInputs(advantages=case["advantages"][:, None].expand(shape).reshape(-1),
                             mask=case["mask"].reshape(-1), row=row, n_rows=shape[0])
        per_token, _ = token_objective(logps.float(), inputs, opts)
        return aggregate_dense(per_token.reshape(shape), case["mask"], opts.aggregation, None, opts)
    return fn


def rel_l2(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def measure(n: int, h: int, v: int, seed: int, repeats: int, impls: list[str]) -> list[dict]:
    case = make_inputs(n, h, v, seed)
    ref_h, ref_w, _ = _grads(_ours(dense_grpo_loss), case["hidden"].double(), case["weight"].double(), case)
    runs = {
        "dense-bf16": (_ours(dense_grpo_loss), torch.bfloat16),
        "tiled-bf16": (_ours(tiled_grpo_loss), torch.bfloat16),
        "trl-autocast": (_trl(autocast=True), torch.float32),
        "trl-bf16": (_trl(autocast=False), torch.bfloat16),
        "tiled-fp32": (_ours(tiled_grpo_loss), torch.float32),
    }
    # the floor: the exact gradient, rounded once to bf16 (what any bf16 gradient carries at least)
    rows = [dict(size=f"N={n} H={h} V={v}", impl="bf16-floor", err_hidden=rel_l2(ref_h.bfloat16(), ref_h),
                 err_weight=rel_l2(ref_w.bfloat16(), ref_w), time=float("nan"))]
    for name in impls:
        fn, dtype = runs[name]
        times = []
        for _ in range(repeats):
            gh, gw, seconds = _grads(fn, case["hidden"].to(dtype), case["weight"].to(dtype), case)
            times.append(seconds)
        rows.append(dict(size=f"N={n} H={h} V={v}", impl=name, err_hidden=rel_l2(gh, ref_h),
                         err_weight=rel_l2(gw, ref_w), time=sorted(times)[len(times) // 2]))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", default=list(DEFAULT_SIZES), help="N,H,V triples")
    p.add_argument("--impl", nargs="+", default=["dense-bf16", "tiled-bf16", "trl-autocast", "trl-bf16", "tiled-fp32"])
    p.add_argument("--repeats", type=int, default=3, help="timed runs per impl (median)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{'size':<24} {'impl':<14} {'rel L2 grad h':>14} {'rel L2 grad W':>14} {'time s':>8}")
    for size in args.sizes:
        n, h, v = (int(x) for x in size.split(","))
        for row in measure(n, h, v, args.seed, args.repeats, args.impl):
            print(f"{row['size']:<24} {row['impl']:<14} {row['err_hidden']:>14.2e} {row['err_weight']:>14.2e} "
                  f"{row['time']:>8.3f}", flush=True)


if __name__ == "__main__":
    main()
