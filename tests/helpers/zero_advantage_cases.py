"""The zero-advantage filter's exactness cases (fp64): a tiny linear "lm head", a GRPO clipped
per-token loss and each framework's own aggregation, shared by ``tests/test_zero_advantage.py``
and its two-rank twin ``tests/test_zero_advantage_ddp.py``."""

from __future__ import annotations

import torch

from grpo_patches.adapters.nemo_rl.loss_modes import DENOMINATORS as NEMO_RL_DENOMINATORS
from grpo_patches.adapters.trl.loss_modes import denominator as trl_denominator
from grpo_patches.adapters.verl.loss_modes import denominator as verl_denominator
from grpo_patches.zero_advantage import ZeroAdvantageFilter

DTYPE = torch.float64
TOL = 1e-6  # max relative difference, fp64
HIDDEN, VOCAB, WIDTH, ROWS = 8, 11, 7, 6
GA, MAX_COMPLETION, NUM_ITEMS, GLOBAL_TOKENS, GLOBAL_ROWS = 3, 9, 57.0, 123.0, 16.0


def _row_mean(l, m, clamp=True):  # noqa: E741 - l is the per-token loss
    count = m.sum(-1).clamp(min=1.0) if clamp else m.sum(-1)
    return (l * m).sum(-1) / count


#: (framework, mode, what its loss divides by, the framework's aggregation of per-token loss l with mask m)
CASES = {
    "trl-grpo": ("trl", "grpo", trl_denominator("grpo"), lambda l, m: _row_mean(l, m).mean() / GA),
    "trl-sapo": ("trl", "sapo", trl_denominator("sapo"), lambda l, m: _row_mean(l, m).mean() / GA),
    "trl-bnpo": ("trl", "bnpo", trl_denominator("bnpo"), lambda l, m: (l * m).sum() / m.sum().clamp(min=1.0) / GA),
    "trl-dr_grpo": ("trl", "dr_grpo", trl_denominator("dr_grpo"), lambda l, m: (l * m).sum() / (l.size(0) * MAX_COMPLETION) / GA),
    "trl-luspo": ("trl", "luspo", trl_denominator("luspo"), lambda l, m: (l * m).sum(-1).mean() / GA),
    "trl-dapo": ("trl", "dapo", trl_denominator("dapo"), lambda l, m: (l * m).sum() / (NUM_ITEMS / 2 * GA / 2)),
    "trl-cispo": ("trl", "cispo", trl_denominator("cispo"), lambda l, m: (l * m).sum() / (NUM_ITEMS / 2 * GA / 2)),
    "trl-vespo": ("trl", "vespo", trl_denominator("vespo"), lambda l, m: (l * m).sum() / (NUM_ITEMS / 2 * GA / 2)),
    "verl07-token-mean": ("verl", "token-mean", verl_denominator("legacy", "token-mean"),
                          lambda l, m: (l * m).sum() / m.sum()),
    "verl07-seq-mean-token-sum": ("verl", "seq-mean-token-sum", verl_denominator("legacy", "seq-mean-token-sum"),
                                  lambda l, m: (l * m).sum(-1).sum() / (m.sum(-1) > 0).sum()),
    "verl07-seq-mean-token-mean": (
        "verl", "seq-mean-token-mean", verl_denominator("legacy", "seq-mean-token-mean"),
        lambda l, m: _row_mean(l, m, clamp=False).mean()
    ),
    "verl07-seq-mean-token-sum-norm": (
        "verl", "seq-mean-token-sum-norm", verl_denominator("legacy", "seq-mean-token-sum-norm"),
        lambda l, m: (l * m).sum() / (m.sum(-1) > 0).sum() / m.shape[-1]
    ),
    "verl06-seq-mean-token-sum-norm": (
        "verl", "seq-mean-token-sum-norm", verl_denominator("legacy-0.6", "seq-mean-token-sum-norm"),
        lambda l, m: (l * m).sum() / m.shape[-1]
    ),
    "verl09-token-mean": ("verl", "token-mean", verl_denominator("engine", "token-mean"),
                          lambda l, m: (l * m).sum() / GLOBAL_TOKENS),
    "verl09-seq-mean-token-mean": (
        "verl", "seq-mean-token-mean", verl_denominator("engine", "seq-mean-token-mean"),
        lambda l, m: _row_mean(l, m).sum() / GLOBAL_ROWS
    ),
    "nemo_rl-token": ("nemo_rl", "TOKEN_LEVEL", NEMO_RL_DENOMINATORS["TOKEN_LEVEL"],
                      lambda l, m: (l * m).sum() / GLOBAL_TOKENS),
    "nemo_rl-sequence": ("nemo_rl", "SEQUENCE_LEVEL", NEMO_RL_DENOMINATORS["SEQUENCE_LEVEL"],
                         lambda l, m: _row_mean(l, m).sum() / GLOBAL_ROWS),
}


def make_model(seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(HIDDEN, VOCAB).to(DTYPE)


def token_logps(model: torch.nn.Linear, batch: dict) -> torch.Tensor:
    logits = model(batch["hidden"])
    return torch.log_softmax(logits, dim=-1).gather(-1, batch["tokens"].unsqueeze(-1)).squeeze(-1)


def make_batch(seed: int, zero_rows, rows: int = ROWS, per_token: bool = False) -> dict:
    """Ragged rows (1..WIDTH tokens), rows in ``zero_rows`` with advantage exactly 0."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, WIDTH + 1, (rows,), generator=g)
    batch = {
        "hidden": torch.randn(rows, WIDTH, HIDDEN, generator=g, dtype=DTYPE),
        "tokens": torch.randint(VOCAB, (rows, WIDTH), generator=g),
        "mask": (torch.arange(WIDTH) < lengths[:, None]).to(DTYPE),
    }
    advantages = torch.randn(rows, generator=g, dtype=DTYPE)
    if per_token:
        advantages = advantages[:, None] * torch.rand(rows, WIDTH, generator=g, dtype=DTYPE)
    advantages[list(zero_rows)] = 0.0
    batch["advantages"] = advantages
    with torch.no_grad():  # old log-probs off by up to ~0.5 so both clip branches are taken
        batch["old_logps"] = token_logps(make_model(), batch) + 0.5 * torch.randn(rows, WIDTH, generator=g, dtype=DTYPE)
    return batch


def grpo_token_loss(logps, old_logps, advantages, eps_low=0.2, eps_high=0.28):
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    ratio = torch.exp(logps - old_logps)
    return -torch.min(ratio * adv, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * adv)


def loss_and_grads(model, batch, aggregate, filt: ZeroAdvantageFilter | None = None, weights=None):
    rows = slice(None) if filt is None else filt.keep
    part = {k: v[rows] for k, v in batch.items()}
    per_token = grpo_token_loss(token_logps(model, part), part["old_logps"], part["advantages"])
    if filt is not None:
        per_token = per_token * (filt.weights if weights is None else weights)[:, None]
    loss = aggregate(per_token, part["mask"])
    return [loss.detach(), *torch.autograd.grad(loss, list(model.parameters()))]


def max_rel_diff(got: list, want: list) -> float:
    worst = 0.0
    for a, b in zip(got, want):
        scale = b.abs().max().item()
        diff = (a - b).abs().max().item()
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def tokens_of(batch, rows) -> int:
    return int(batch["mask"][list(rows)].sum().item())


BATCHES = {  # name -> (batch, zero rows, expected rows_dropped, expected padding rows)
    "mixed": (make_batch(1, [0, 2, 5]), [0, 2, 5], 3, 0),
    "all-zero": (make_batch(2, range(ROWS)), range(ROWS), ROWS - 1, 1),
    "none-zero": (make_batch(3, []), [], 0, 0),
    "per-token": (make_batch(4, [1, 3], per_token=True), [1, 3], 2, 0),
}
