"""No padding work for the rows the zero-advantage filter keeps (TRL): same gradients, fewer tokens.

The workload makes the kept rows narrower than the generation batch on both sides: prompts of
7 words (their groups get a constant reward: dropped) and of 2 words (kept), and a tiny model
whose ``<eos>`` is boosted so completions end at varied lengths; among the short prompts the
group holding the batch's longest completion is dropped too, so the kept rows' completions are
shorter than the dropped ones'. Micro-batches of 8 rows, generation batches of 16 (4 prompts),
GA=3 with steps_per_generation=2 (TRL computes old log-probs: the deferred pass is trimmed too).

Gradients are compared per optimizer step, before SGD applies them (``max_grad_norm=0``:
unclipped; ``learning_rate=0`` so every step's gradient is taken at the same weights and
rounding differences cannot compound), relative L2 over all parameters, fp32: ≤ 1e-6
(measured ≤ 6.5e-7: the trimmed forward's matmuls and attention run on other shapes; the
filter alone measures ~1e-8). In float64 the trimmed forward's log-probs equal the full
forward's bitwise (:func:`test_trimmed_forward_is_bitwise_in_float64`), so the fp32 difference
is rounding. A planted fault (one column too many cut, leading or trailing) moves the
gradient by > 0.3 relative.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from grpo_patches.demo import tiny_model  # noqa: E402
from grpo_patches_testing.trl_train import train  # noqa: E402

ONLY_FILTER = dict(recompute=False, logprob_skip=False, tiled_loss=False)
CONFIG = dict(steps=3, bf16=False, optim="sgd", learning_rate=0.0, max_grad_norm=0.0, max_completion_length=12,
              per_device_train_batch_size=8, gradient_accumulation_steps=3, steps_per_generation=2)
LONG_WORDS = 7


def dataset():
    from datasets import Dataset

    long = tiny_model.prompts(4, words_per_prompt=LONG_WORDS, seed=1)
    short = tiny_model.prompts(4, words_per_prompt=2, seed=2)
    return Dataset.from_dict({"prompt": [p for pair in zip(long, short) for p in pair]})


def reward(prompts: list[str], completions: list[str], **_) -> list[float]:
    """Constant (zero advantage) for long prompts and for the group of the batch's longest
    completion; the character-sum hash elsewhere."""
    lengths = [len(c.split()) for c in completions]
    longest = prompts[lengths.index(max(lengths))]
    return [1.0 if len(p.split()) >= LONG_WORDS or p == longest else (sum(map(ord, c)) % 97) / 97
            for p, c in zip(prompts, completions)]


class StepGradients(TrainerCallback):
    """Every optimizer step's accumulated gradient (before the step)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None})


def rel_l2(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert got.keys() == ref.keys()
    diff = sum(float((got[n] - ref[n]).norm() ** 2) for n in ref)
    return (diff / sum(float(r.norm() ** 2) for r in ref.values())) ** 0.5


@functools.lru_cache(maxsize=None)
def run(patched: bool, fault: str | None = None):
    """One training run; ``fault``: cut one column too many (``"lead"`` / ``"tail"``)."""
    from grpo_patches.adapters.trl import trim

    grads, cuts = StepGradients(), []
    original = trim.columns

    def spy(arguments):
        cut = original(arguments)
        if fault == "lead" and cut.lead:
            cut = trim.Columns(cut.lead + 1, cut.tail)
        if fault == "tail" and cut.tail:
            cut = trim.Columns(cut.lead, cut.tail + 1)
        cuts.append((cut, int(arguments["input_ids"].size(0))))
        return cut

    trim.columns = spy
    try:
        result = train(patched, ONLY_FILTER if patched else None, reward_funcs=reward, dataset=dataset(),
                       model_path=tiny_model.tiny_model_path(eos_boost=20.0), callbacks=[grads],
                       count_forwards=True, **CONFIG)
    finally:
        trim.columns = original
    result.extra.update(grads=grads.steps, cuts=cuts)
    return result


def test_trimmed_kept_rows_give_the_same_gradient_every_step():
    ref, got = run(False), run(True)
    assert len(ref.extra["grads"]) == len(got.extra["grads"]) == 3
    for want, have in zip(ref.extra["grads"], got.extra["grads"]):
        assert rel_l2(have, want) <= 1e-6
    cuts = got.extra["cuts"]
    # the workload exercises both sides, on kept rows narrower than the generation batch
    assert any(cut.lead for cut, _ in cuts) and any(cut.tail for cut, _ in cuts)
    saved = got.savings
    assert saved["padding_tokens_skipped"] == sum(cut.tokens(rows) for cut, rows in cuts) > 0
    assert got.metrics("grpo_patches/padding_tokens_skipped")
    assert "padding token positions" in got.notes()["zero_advantage_filter"]
    # the tokens really not computed: the forwards beneath the patches saw fewer
    assert got.forwards.tokens < ref.forwards.tokens


@pytest.mark.parametrize("fault", ["lead", "tail"])
def test_one_column_too_many_is_caught(fault):
    ref, bad = run(False), run(True, fault)
    assert any(getattr(cut, fault) for cut, _ in bad.extra["cuts"])
    worst = max(rel_l2(have, want) for want, have in zip(ref.extra["grads"], bad.extra["grads"]))
    assert worst > 1e-4


def test_leading_padding_kept_for_a_model_without_arange_positions(monkeypatch):
    """A model whose positions are not known to be ``arange`` keeps its leading columns."""
    from grpo_patches.adapters.trl import trim

    ids = torch.tensor([[0, 0, 5, 6, 7, 0], [0, 4, 5, 6, 0, 0]])
    model = torch.nn.Module()
    model.config = type("Config", (), {"model_type": "qwen2_vl"})()
    arguments = {"input_ids": ids, "attention_mask": (ids != 0).long(), "logits_to_keep": 3, "model": model}
    assert trim.columns(arguments) == trim.Columns(lead=0, tail=1)
    model.config.model_type = "qwen2"
    assert trim.columns(arguments) == trim.Columns(lead=1, tail=1)
    out = trim.trimmed(arguments, trim.Columns(lead=1, tail=1))
    assert out["input_ids"].tolist() == [[0, 5, 6, 7], [4, 5, 6, 0]] and out["logits_to_keep"] == 2
    assert isinstance(out["model"], trim.WithPositions) and out["model"].start == 1


def _logps(model, input_ids, attention_mask, logits_to_keep):
    """TRL's log-prob computation (0.20's logits path), on one call's arguments."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1][:, -logits_to_keep:]
    return torch.log_softmax(logits, -1).gather(-1, input_ids[:, -logits_to_keep:, None])[..., 0]


def test_trimmed_forward_is_bitwise_in_float64():
    """Leading and trailing padding cut, positions passed: the same log-probs bitwise (float64;
    without the positions RoPE's angles would differ by rounding: ~5e-9 here)."""
    from grpo_patches.adapters.trl import trim

    model = tiny_model.build_model().double().eval()
    ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9, 10, 0, 0, 0], [0, 0, 4, 5, 6, 7, 8, 9, 0, 0, 0, 0]])
    arguments = {"model": model, "input_ids": ids, "attention_mask": (ids != 0).long(), "logits_to_keep": 6}
    cut = trim.columns(arguments)
    assert cut == trim.Columns(lead=2, tail=3)
    with torch.no_grad():
        full = _logps(**arguments)
        short = trim.trimmed(arguments, cut)
        got = trim.widen(_logps(**short), cut, fill=torch.full_like(full, -7.0))
    used = arguments["attention_mask"][:, -6:].bool()
    assert torch.equal(got[used], full[used])
    assert (got[:, -3:] == -7.0).all()  # the cut columns come from fill (the old log-probs: ratio 1)
