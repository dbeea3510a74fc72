"""The fused fold's Triton kernels (CUDA's tile path), run on CPU through Triton's interpreter.

``TRITON_INTERPRET=1`` with ``triton==3.9.0`` executes the ``@triton.jit`` kernels on CPU tensors,
so the kernels' arithmetic is checked here on every run; their speed only on a GPU
(``benchmarks/gpu.sh``). Small shapes, a 32-column kernel block and small vocabulary chunks, so
every tile crosses several chunks, blocks and column splits, with the label in one chunk of many.
Every option the fold reads is covered: temperature, softcap, logit scale, bias, masks, entropy
(as output, bonus and gradient), every objective and aggregation; fp32 against dense at 1e-5, bf16
at the floor (the exact gradient rounded once), and planted faults that the comparisons catch.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton's first import: it fixes how kernels are built
triton = pytest.importorskip("triton")

from grpo_patches.errors import OptionError  # noqa: E402
from grpo_patches.tiled_loss import AGGREGATIONS, dense_grpo_loss, tiled_grpo_loss, tiled_token_stats  # noqa: E402
from grpo_patches.tiled_loss import fold, fold_kernels, gemm  # noqa: E402
from grpo_patches.tiled_loss.options import resolve_options  # noqa: E402
from tests.helpers.tiled_loss_helpers import (  # noqa: E402
    compare,
    make_case,
    max_rel,
    policy_case,
    rel_l2,
    run,
    trl_loss,
)

if not torch.cuda.is_available() and isinstance(triton.language.sum, triton.runtime.jit.JITFunction):
    pytestmark = pytest.mark.skip(reason=(
        "Triton was imported before TRITON_INTERPRET=1 was set and no GPU is here: run with TRITON_INTERPRET=1 "
        "(bash scripts/run pytest sets it on machines without a GPU)"))

#: compiled kernels on CUDA tensors where a GPU is (benchmarks/gpu.sh runs this file), else the interpreter
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
V = 300  # vocabulary of the cases: 3 chunks of 128 columns (the last one 44) at 8 x 128 x 4 bytes
SMALL = dict(tile_size=8, tile_memory_bytes=8 * 4 * 128)


@pytest.fixture(autouse=True)
def fold_on(monkeypatch):
    """The fold's kernels (compiled on a GPU, else through Triton's interpreter), blocks small enough to cross."""
    monkeypatch.setenv(fold.KERNEL_ENV, "triton")
    monkeypatch.setattr(fold_kernels, "BLOCK", 64)  # 2 blocks per 128-column chunk, a part of one in the last


def _on_device(case: dict) -> dict:
    return {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in case.items()}


@pytest.fixture(scope="module")
def case():
    return _on_device(make_case(V=V))


def _transform(r: torch.Tensor, opts) -> torch.Tensor:
    if opts.logit_softcap is not None:
        r = torch.tanh(r * opts.logit_scale / opts.logit_softcap) * opts.logit_softcap
    else:
        r = r * opts.logit_scale
    return r / opts.temperature


TRANSFORMS = {
    "plain": dict(),
    "temperature_scale": dict(temperature=0.7, logit_scale=0.8),
    "softcap": dict(logit_softcap=1.5),  # |r| up to ~9: the tanh's series and exp branches
    "all": dict(temperature=1.3, logit_scale=1 / 1.7, logit_softcap=0.8),
}


@pytest.mark.parametrize("transform, bias", [("plain", False), ("temperature_scale", True), ("softcap", False),
                                             ("all", True)])
@pytest.mark.parametrize("rows", [3, 12])  # 3 rows: several column splits per row; 12: one
def test_kernels_match_torch_in_fp64(transform, bias, rows, monkeypatch):
    """One chunk's statistics and logit gradient (entropy term included) against fp64 autograd."""
    monkeypatch.setattr(fold_kernels, "BLOCK", 32)  # several blocks per split, the last one partly masked
    opts = resolve_options(**TRANSFORMS[transform])
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 200, generator=g) * 3).to(DEVICE)
    b = torch.randn(250, generator=g).to(DEVICE) if bias else None
    col0 = 50  # the chunk is columns 50..249 of a 250-column vocabulary
    labels = torch.randint(0, 250, (rows,), generator=g)
    labels[0] = 10  # a label outside the chunk
    labels = labels.to(DEVICE)
    parts = fold_kernels.chunk_stats(x, None if b is None else b[col0:], labels, col0, opts, True)
    m, s, t, zy = fold._merge(None, parts)

    r = x.double() + (0 if b is None else b[col0:].double())
    z = _transform(r.requires_grad_(), opts)
    log_p = torch.log_softmax(z, -1)
    lse = torch.logsumexp(z, -1)
    assert max_rel(m + torch.log(s), lse.detach()) <= 1e-6
    assert max_rel(torch.log(s) - t / s, -(log_p.exp() * log_p).sum(-1).detach()) <= 1e-5
    inside = (labels >= col0).nonzero().flatten()
    assert zy[0] == 0
    assert max_rel(zy[inside], z.detach()[inside].gather(1, (labels[inside] - col0)[:, None]).squeeze(1)) <= 1e-6

    gl, ge = torch.randn(rows, generator=g).to(DEVICE), torch.randn(rows, generator=g).to(DEVICE)
    ent = -(log_p.exp() * log_p).sum(-1)
    # a label outside the chunk: its logit is a constant here, so log p_y = const - lse
    label_lp = torch.where(labels >= col0, log_p.gather(1, (labels - col0).clamp(min=0)[:, None]).squeeze(1), -lse)
    without = torch.autograd.grad((gl.double() * label_lp).sum(), r, retain_graph=True)[0]
    with_entropy = torch.autograd.grad((gl.double() * label_lp + ge.double() * ent).sum(), r)[0]
    for entropy, expected in ((False, without), (True, with_entropy)):
        d = x.clone()
        fold_kernels.chunk_logit_grad_(
            d, d, None if b is None else b[col0:], labels, col0, lse.detach().float(), gl,
            ent.detach().float() if entropy else None, ge if entropy else None, opts,
        )
        assert max_rel(d, expected) <= 1e-5, entropy


@pytest.mark.parametrize("rows", [3, 12])
def test_bf16_gradient_is_written_in_place_or_apart(rows):
    """bf16 output: over the front of each fp32 row (one program per row) or, with column splits, apart."""
    opts = resolve_options()
    x = (torch.randn(rows, 200) * 3).to(DEVICE)
    labels = torch.randint(0, 200, (rows,)).to(DEVICE)
    m, s, _, _ = fold._merge(None, fold_kernels.chunk_stats(x, None, labels, 0, opts, False))
    lse, g = m + torch.log(s), torch.randn(rows).to(DEVICE)
    expected = x.clone()
    fold_kernels.chunk_logit_grad_(expected, expected, None, labels, 0, lse, g, None, None, opts)
    apart = fold_kernels.grad_needs_own_rows(x, torch.bfloat16)
    assert apart == (rows == 3) or DEVICE == "cuda"  # a GPU's many programs split 12 rows too
    out = torch.empty(rows, 200, dtype=torch.bfloat16, device=DEVICE) if apart else x.view(torch.bfloat16)[:, :200]
    fold_kernels.chunk_logit_grad_(x, out, None, labels, 0, lse, g, None, None, opts)
    assert torch.equal(out, expected.bfloat16())


OBJECTIVES = {
    "grpo": trl_loss("grpo", old_logps=1),
    "dapo_kl_is": trl_loss("dapo", old_logps=1, ref_logps=1, is_weights=1, beta=0.04, kl_ratio_correction=True),
    "dr_grpo": trl_loss("dr_grpo", old_logps=1, max_completion_length=9),
    "cispo": trl_loss("cispo", old_logps=1, epsilon_high=1.1),
    "sapo": trl_loss("sapo", old_logps=1, entropy_coef=0.02, return_entropy=True),
    "vespo": trl_loss("vespo", old_logps=1, is_weights=1),
    "luspo_sequence": trl_loss("luspo", old_logps=1, importance_sampling_level="sequence", normalizer=5.0),
    "dual_clip_opsm": trl_loss("bnpo", old_logps=1, ref_logps=1, sampling_logps=1, beta=0.1, kl_estimator="k2",
                               delta=1.5, off_policy_mask_threshold=0.05, return_token_metrics=True),
}


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_every_objective_matches_dense(case, objective):
    transform = sorted(TRANSFORMS)[sorted(OBJECTIVES).index(objective) % len(TRANSFORMS)]  # each twice
    compare(case, **OBJECTIVES[objective], **TRANSFORMS[transform], **SMALL)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_every_aggregation_with_entropy_bonus_matches_dense(case, aggregation):
    compare(case, aggregation=aggregation, old_logps=1, ref_logps=1, beta=0.01, entropy_coef=0.05,
            entropy_aggregation="seq-mean-token-mean", return_entropy=True, return_logps=True,
            logit_softcap=1.5, **SMALL)


def test_token_masks_and_per_token_advantages_match_dense():
    case = _on_device(make_case(V=V, per_token_adv=True, seed=3))
    g = torch.Generator().manual_seed(5)
    masks = _on_device({"policy_token_mask": (torch.rand(3, 7, generator=g) > 0.3).float(),
                        "entropy_token_mask": (torch.rand(3, 7, generator=g) > 0.5).float()})
    options = trl_loss("grpo", old_logps=1, entropy_coef=0.1, temperature=0.9, entropy_normalizer=4.0,
                       entropy_aggregation="token-mean", **SMALL)
    tiled = run(tiled_grpo_loss, case, **masks, **options)
    dense = run(dense_grpo_loss, case, **masks, **options)
    assert max_rel(tiled[0], dense[0]) <= 1e-5
    for name, grad in dense[2].items():
        assert max_rel(tiled[2][name], grad) <= 1e-5, name


@pytest.mark.parametrize("shape", [dict(tile_size=None), dict(tile_size=21, tile_memory_bytes=2**20), SMALL,
                                   dict(tile_size=1, tile_memory_bytes=1)])
def test_tile_and_chunk_shapes_match_dense(case, shape):
    """The default shape (one tile, one chunk), one chunk of all columns, several chunks, 1 x 128."""
    compare(case, **trl_loss("dapo", old_logps=1, entropy_coef=0.01, return_logps=True), **shape)


def test_flat_unbiased_inputs_and_nothing_selected():
    case = _on_device(make_case(V=V, bias=False, seed=6))
    flat = dict(case, hidden=case["hidden"].reshape(21, -1), labels=case["labels"].reshape(-1),
                advantages=case["advantages"].repeat_interleave(7), mask=case["mask"].reshape(-1))
    flat = {k: v.reshape(-1) if k in ("old_logps", "ref_logps") else v for k, v in flat.items()}
    compare(flat, **trl_loss("dapo", old_logps=1), **SMALL)
    empty = dict(case, mask=torch.zeros(3, 7, device=DEVICE))
    loss, _, grads = run(tiled_grpo_loss, empty, **SMALL)
    assert loss == 0 and all((grad == 0).all() for grad in grads.values())


def test_token_stats_through_the_fold(case):
    options = dict(temperature=0.7, logit_scale=0.8, logit_softcap=1.5)
    _, dense, _ = run(dense_grpo_loss, case, return_logps=True, return_entropy=True, **options)
    for tile in (None, 4):
        logps, entropy = tiled_token_stats(case["hidden"], case["weight"], case["labels"], case["mask"],
                                           bias=case["bias"], tile_size=tile, **options)
        assert max_rel(logps, dense["logps"]) <= 1e-5 and max_rel(entropy, dense["entropy"]) <= 1e-5
        assert (logps[case["mask"] == 0] == 0).all()


def test_bf16_gradient_matches_the_cuda_strategy_of_the_torch_path(monkeypatch):
    """bf16 operands, fp32 logits and statistics, the logit gradient rounded once with the one-hot term
    folded in: the error of the torch path's CUDA strategy (measured at the floor on an H100 at
    N 2048, H 1024, V 32000; ~1.3x at these small sizes), far below dense bf16's."""
    monkeypatch.setattr(fold_kernels, "BLOCK", 128)  # the interpreter's time grows with the blocks
    options = trl_loss("dapo", temperature=0.9, tile_size=64, tile_memory_bytes=64 * 4 * 384)
    hidden, weight, *rest = (t.to(DEVICE) for t in policy_case(0, options["temperature"], B=2, T=32, V=1000))

    def grads(fn, h, w):
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        fn(h, w, *rest, **options)[0].backward()
        return h.grad, w.grad

    ref = grads(dense_grpo_loss, hidden.double(), weight.double())
    dense = grads(dense_grpo_loss, hidden, weight)
    tiled = grads(tiled_grpo_loss, hidden, weight)
    monkeypatch.setenv(fold.KERNEL_ENV, "torch")
    monkeypatch.setattr(gemm, "gemm_mode", lambda dtype, device: gemm.FP32_OUT)
    torch_path = grads(tiled_grpo_loss, hidden, weight)
    for r, d, t, p in zip(ref, dense, tiled, torch_path):
        floor = rel_l2(r.bfloat16(), r)
        assert t.dtype == torch.bfloat16
        assert rel_l2(t, r) <= 1.05 * rel_l2(p, r), (rel_l2(t, r), rel_l2(p, r))
        assert rel_l2(t, r) <= min(1.5 * floor, 0.75 * rel_l2(d, r)), (rel_l2(t, r), floor, rel_l2(d, r))


def test_gemm_count_recomputes_all_but_the_last_chunk(case, monkeypatch):
    calls = []
    original = fold.mm_fp32
    monkeypatch.setattr(fold, "mm_fp32", lambda *a, **k: calls.append(1) or original(*a, **k))
    n = int(case["mask"].sum())  # one tile of all unmasked tokens
    for shape, chunks in ((dict(tile_size=None), 1), (dict(tile_size=None, tile_memory_bytes=4 * n * 128), 3)):
        calls.clear()
        run(tiled_grpo_loss, case, **shape)
        assert len(calls) == chunks + chunks - 1, (shape, len(calls))


def test_rows_without_gradient_leave_the_gradient_sweep_when_that_pays(case, monkeypatch):
    """A 0 policy_token_mask on most rows: only the rest go through the gradient sweep (every chunk
    recomputed for them); a few such rows in a one-chunk tile: the held chunk is used for all."""
    rows_seen = []
    original = fold.Fold.apply_grads
    monkeypatch.setattr(fold.Fold, "apply_grads", lambda self, grads, hidden, *a: rows_seen.append(
        hidden.shape[0]) or original(self, grads, hidden, *a))
    n = int(case["mask"].sum())
    for few, options in ((False, SMALL), (True, dict(tile_size=None))):
        mask = torch.zeros(3, 7, device=DEVICE)
        mask.view(-1)[torch.nonzero(case["mask"].view(-1)).flatten()[: 2 if not few else n - 1]] = 1.0
        rows_seen.clear()
        tiled = run(tiled_grpo_loss, case, policy_token_mask=mask, **trl_loss("dapo"), **options)
        dense = run(dense_grpo_loss, case, policy_token_mask=mask, **trl_loss("dapo"), **options)
        assert sum(rows_seen) == (n if few else 2), rows_seen
        for name, grad in dense[2].items():
            assert max_rel(tiled[2][name], grad) <= 1e-5, name


@pytest.mark.parametrize("fault", ["held_chunk_reused", "merge_not_rescaled"])
def test_planted_faults_fail_the_comparison(case, monkeypatch, fault):
    """Bugs the fold could have: the held chunk taken for any chunk, partial sums merged unscaled."""
    if fault == "held_chunk_reused":
        def raw(self, i, hidden):
            c0, c1 = self.chunks[i]
            x = self.buffer[: hidden.shape[0] * (c1 - c0)].view(hidden.shape[0], c1 - c0)
            if self.held is None or self.held[1] is not hidden:  # the chunk index is not checked
                fold.mm_fp32(hidden, self.weight[c0:c1].t(), out=x)
            return x

        monkeypatch.setattr(fold.Fold, "_raw", raw)
    else:
        exact = fold._merge

        def merge(state, part):
            pm, ps, pt, pzy = part
            if state is None:
                return exact(None, part)
            return torch.maximum(pm.max(0).values, state[0]), state[1] + ps.sum(0), state[2] + pt.sum(0), \
                state[3] + pzy.sum(0)

        monkeypatch.setattr(fold, "_merge", merge)
    with pytest.raises(AssertionError):
        compare(case, **trl_loss("grpo", old_logps=1, entropy_coef=0.05, return_entropy=True), **SMALL)


def test_kernel_choice_and_its_errors(monkeypatch):
    cpu = torch.device("cpu")
    case = make_case(V=V)
    assert not fold.fold_enabled(cpu, torch.float64)  # fp64 (gradcheck) keeps the torch path
    monkeypatch.setenv(fold.KERNEL_ENV, "torch")
    assert not fold.fold_enabled(cpu, torch.float32)
    monkeypatch.setenv(fold.KERNEL_ENV, "auto")
    assert not fold.fold_enabled(cpu, torch.float32)  # auto: CUDA only
    monkeypatch.setenv(fold.KERNEL_ENV, "cuda")
    with pytest.raises(OptionError, match="GRPO_PATCHES_TILED_KERNEL='cuda' is not supported"):
        fold.fold_enabled(cpu, torch.float32)
    monkeypatch.setenv(fold.KERNEL_ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(OptionError, match="TRITON_INTERPRET=1"):
        run(tiled_grpo_loss, case)
    monkeypatch.setattr(fold, "_triton_imports", lambda: False)
    with pytest.raises(OptionError, match="pip install triton"):
        fold.fold_enabled(cpu, torch.float32)
