"""No padding work for the rows the zero-advantage filter keeps, in real verl (``use_remove_padding=False``).

A batch whose kept rows are narrower than the rollout's width on both sides (prompts of 2-4 of
6 columns, responses of 1-5 of 8), the dropped rows holding the longest prompts and responses.

Legacy line (``DataParallelPPOActor``, :mod:`grpo_patches.adapters.verl.trim_legacy`): each
packed micro-batch's training forward runs on the columns its rows use; the gradient before
every optimizer step equals unpatched (fp32, rel <= 1e-6), the metrics are the filter's
without the trim, ``grpo_patches/padding_tokens_skipped`` equals the columns the forwards did
not get (from the model's own inputs), one column too many cut (leading or trailing) moves the
gradient, and every kept token reaches the model at verl's own position. Remove-padding on:
nothing is cut.

Engine line (0.8+): no trim is needed — the FSDP engine pads each micro-batch to its own
longest row (nested tensors); checked on the inputs the model gets.
"""

from __future__ import annotations

import importlib.util

import pytest

from grpo_patches_testing import verl_actor_runs as h

from grpo_patches_testing import verl_engine_runs as engine_runs
from tests.helpers.verl_fixtures import process_group  # noqa: F401  (autouse: one process group per module)

if h.VERL is None:
    pytest.skip("verl is not installed (the compat cells install it)", allow_module_level=True)

import torch  # noqa: E402

TOL = 1e-6
LEGACY = h.line().startswith("legacy")
FILTER = {"zero_advantage_filter": True, "logprob_skip": False}
METRIC = "grpo_patches/padding_tokens_skipped"
WIDTH = h.PROMPT + h.RESPONSE
ZERO = h.ZERO_ROWS["interleaved"]


def narrow_kept_batch(seed: int = 7) -> dict:
    """verl's rollout layout; kept rows narrower on both sides, the dropped rows the widest."""
    base = h.make_batch(zero_rows=ZERO)
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(h.ROWS, WIDTH, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i in range(h.ROWS):
        if i in ZERO:  # alternately the longest prompt or the longest response
            p = h.PROMPT if i % 2 else int(torch.randint(2, h.PROMPT + 1, (1,), generator=g))
            r = h.RESPONSE if not i % 2 else int(torch.randint(1, h.RESPONSE + 1, (1,), generator=g))
        else:
            p = int(torch.randint(2, h.PROMPT - 1, (1,), generator=g))
            r = int(torch.randint(1, h.RESPONSE - 2, (1,), generator=g))
        ids[i, h.PROMPT - p : h.PROMPT + r] = torch.randint(3, h.VOCAB, (p + r,), generator=g)
        attn[i, h.PROMPT - p : h.PROMPT + r] = 1
    mask = attn[:, h.PROMPT:].clone()
    batch = {"prompts": ids[:, : h.PROMPT].clone(), "input_ids": ids, "attention_mask": attn,
             "position_ids": torch.clamp(attn.cumsum(1) - 1, min=0), "responses": ids[:, h.PROMPT:].clone(),
             "response_mask": mask, "advantages": base["advantages"][:, :1] * mask.float()}
    with torch.no_grad():
        logits = h.tiny_model(0)(input_ids=ids, attention_mask=attn, position_ids=batch["position_ids"]).logits
        logps = torch.log_softmax(logits[:, -h.RESPONSE - 1 : -1], -1).gather(-1, batch["responses"][..., None])[..., 0]
    batch["old_log_probs"] = logps + 0.3 * torch.randn(logps.shape, generator=g)
    return batch


def test_the_batch_is_the_case_the_trim_is_for():
    batch = narrow_kept_batch()
    kept = torch.tensor([i not in ZERO for i in range(h.ROWS)])
    used = batch["attention_mask"][kept].bool().any(0)
    assert not used[:2].any() and not used[-3:].any()  # kept rows: >= 2 leading, >= 3 trailing columns free
    assert batch["attention_mask"][~kept].bool().any(0).all()  # dropped rows span the whole width
    assert (batch["advantages"][kept].abs().sum(1) > 0).all() and (batch["advantages"][~kept] == 0).all()


def expected_cut(batch: dict, mbs: int, n_mini: int) -> int:
    """Static micro-batches: the filter packs each mini-batch's kept rows, in order, ``mbs`` at a time."""
    total, mini = 0, h.ROWS // n_mini
    for start in range(0, h.ROWS, mini):
        kept = [i for i in range(start, start + mini) if i not in ZERO]
        for j in range(0, len(kept), mbs):
            rows = kept[j : j + mbs]
            used = torch.nonzero(batch["attention_mask"][rows].bool().any(0)).flatten()
            lead = min(int(used[0]), h.PROMPT - 1)
            tail = min(WIDTH - 1 - int(used[-1]), h.RESPONSE - 1)
            total += len(rows) * (lead + tail)
    return total


def skipped_by_shapes(run: h.Run) -> int:
    """Token positions the autograd forwards did not get, from the model's own inputs."""
    return sum(rows * (WIDTH - width) for rows, width in run.grad_shapes)


def steady(metrics: dict) -> dict:
    """verl's metrics that do not measure time or memory."""
    noisy = ("perf/", "timing", "mfu", "memory")
    return {k: v for k, v in metrics.items() if not any(n in k for n in noisy) and k != METRIC}


legacy_only = pytest.mark.skipif(not LEGACY, reason="the legacy actor's padded forward (verl 0.6.1-0.7.x)")


@legacy_only
@pytest.mark.parametrize("dynamic,n_mini,agg", [(False, 1, "token-mean"), (False, 2, "seq-mean-token-sum"),
                                                (True, 1, "seq-mean-token-mean"), (True, 2, "token-mean")])
def test_trim_is_exact_and_counted(dynamic, n_mini, agg, monkeypatch, record_property):
    from grpo_patches.adapters.verl import trim_legacy

    batch = narrow_kept_batch()
    ref = h.legacy_run(None, batch_extra=batch, dynamic=dynamic, n_mini=n_mini, agg=agg)
    got = h.legacy_run(FILTER, batch_extra=batch, dynamic=dynamic, n_mini=n_mini, agg=agg)
    err = h.max_rel(got, ref)
    record_property("exact_trim_grad_rel", err)
    assert len(ref.grads) == n_mini and err <= TOL, err
    assert all(width == WIDTH for _, width in ref.grad_shapes)
    assert all(width < WIDTH for _, width in got.grad_shapes)  # every kept micro-batch was cut
    skipped = got.metrics[METRIC]
    assert skipped == skipped_by_shapes(got) > 0
    assert got.status["savings"][METRIC.split("/")[1]] == skipped
    if not dynamic:
        assert skipped == expected_cut(batch, mbs=3, n_mini=n_mini)
    # the same metrics as the filter without the trim (its own metrics: test_verl_filter)
    monkeypatch.setattr(trim_legacy, "applies", lambda actor: False)
    untrimmed = h.legacy_run(FILTER, batch_extra=batch, dynamic=dynamic, n_mini=n_mini, agg=agg)
    assert untrimmed.metrics[METRIC] == 0 and h.max_rel(untrimmed, ref) <= TOL
    a, b = steady(got.metrics), steady(untrimmed.metrics)
    assert a.keys() == b.keys()
    for key in a:  # fp32 rounding of the log-probs (~1e-7 each; ppo_kl is a mean of their differences)
        assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-6), key


def _faulty_columns(lead: int, tail: int):
    from grpo_patches.adapters.verl import trim_legacy
    from grpo_patches.padding_columns import Columns

    right = trim_legacy.columns

    def columns(micro):
        cut = right(micro)
        return Columns(lead=cut.lead + lead, tail=cut.tail + tail)

    return columns


@legacy_only
@pytest.mark.parametrize("lead,tail", [(1, 0), (0, 1)])
def test_one_column_too_many_is_caught(lead, tail, monkeypatch):
    from grpo_patches.adapters.verl import trim_legacy

    batch = narrow_kept_batch()
    ref = h.legacy_run(None, batch_extra=batch)
    monkeypatch.setattr(trim_legacy, "columns", _faulty_columns(lead, tail))
    got = h.legacy_run(FILTER, batch_extra=batch)
    assert h.max_rel(got, ref) > 1e-3


def rows_as_the_model_saw_them(monkeypatch) -> list:
    """(input_ids, position_ids) of each row's attended tokens, per autograd forward of the next run."""
    seen, count = [], h.count_forwards

    def hook(module, args, kwargs):
        if torch.is_grad_enabled():
            mask = kwargs["attention_mask"].bool()
            seen.extend((kwargs["input_ids"][i][mask[i]].tolist(), kwargs["position_ids"][i][mask[i]].tolist())
                        for i in range(mask.shape[0]))

    def counting(model, run):
        count(model, run)
        model.register_forward_pre_hook(hook, with_kwargs=True)

    monkeypatch.setattr(h, "count_forwards", counting)
    return seen


@legacy_only
@pytest.mark.parametrize("fault", [False, True])
def test_rope_gets_the_original_positions(fault, monkeypatch):
    """Each kept row reaches the model with all its tokens at verl's own ``position_ids``. (A
    gradient cannot show this: RoPE is invariant to shifting a row's positions uniformly, which
    is what renumbering the kept columns from 0 does — the planted fault, caught here.)"""
    from grpo_patches.adapters.verl import trim_legacy

    batch = narrow_kept_batch()
    if fault:
        right = trim_legacy.trimmed

        def renumbered(micro, cut):
            out = right(micro, cut)
            out["position_ids"] = torch.arange(out["input_ids"].shape[1]).expand_as(out["input_ids"])
            return out

        monkeypatch.setattr(trim_legacy, "trimmed", renumbered)
    seen = rows_as_the_model_saw_them(monkeypatch)
    got = h.legacy_run(FILTER, batch_extra=batch)
    assert got.metrics[METRIC] > 0 and len(seen) == h.ROWS - len(ZERO)
    mask = batch["attention_mask"].bool()
    original = {tuple(batch["input_ids"][i][mask[i]].tolist()): batch["position_ids"][i][mask[i]].tolist()
                for i in range(h.ROWS) if i not in ZERO}
    assert {tuple(ids) for ids, _ in seen} == set(original)  # every kept token, nothing else
    same = all(original[tuple(ids)] == positions for ids, positions in seen)
    assert same is not fault


@legacy_only
def test_remove_padding_cuts_nothing():
    """verl unpads every row itself: the trim does not run, the count stays 0."""
    from grpo_patches.adapters.verl import trim_legacy

    model = h.tiny_model(0)
    assert not trim_legacy.applies(h.legacy_actor(model, use_remove_padding=True))
    assert trim_legacy.applies(h.legacy_actor(model))
    if importlib.util.find_spec("flash_attn") is None:  # verl's unpadding imports it (0.6.1 fails with UnboundLocalError)
        pytest.skip("remove-padding does not run on this CPU install: verl's unpadding needs flash_attn")
    batch = narrow_kept_batch()
    got = h.legacy_run(FILTER, batch_extra=batch, use_remove_padding=True)
    ref = h.legacy_run(None, batch_extra=batch, use_remove_padding=True)
    assert got.metrics[METRIC] == 0 and "padding_tokens_skipped" not in got.status["savings"]
    assert h.max_rel(got, ref) <= TOL


@pytest.mark.skipif(LEGACY, reason="the engine line (verl 0.8+)")
def test_engine_pads_each_micro_batch_to_its_own_rows():
    """No trim on the engine line: the filtered micro-batches the padded FSDP engine forwards
    have no column that none of their rows uses (each is padded to its own longest row)."""
    worker = engine_runs.shared_worker()  # use_remove_padding=False
    widths, unused = [], []

    def hook(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if torch.is_grad_enabled() and mask is not None and mask.dim() == 2:
            used = mask.bool().any(0)
            widths.append(int(mask.shape[1]))
            unused.append(int((~used).sum()))

    handle = worker.engine.module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        td = engine_runs.engine_batch(extra=narrow_kept_batch())
        ref = worker.run_td(td, None)
        before = len(widths)
        got = worker.run_td(engine_runs.engine_batch(extra=narrow_kept_batch()), FILTER)
    finally:
        handle.remove()
    assert h.max_rel(got, ref) <= TOL
    assert before and len(widths) > before and not any(unused)
    assert max(widths[before:]) < WIDTH  # the kept rows' micro-batches are already narrower than the rollout
