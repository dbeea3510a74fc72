"""TRL adapter metrics module and the recompute decision's inputs, on stand-in trainers (fast)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest

from grpo_patches import savings
from grpo_patches.adapters.trl import accumulation_window, metrics, old_logprobs


def fake_trainer(training=True):
    return SimpleNamespace(model=SimpleNamespace(training=training),
                           _metrics={"train": defaultdict(list), "eval": defaultdict(list)})


def test_add_count_logs_per_logging_step_and_keeps_the_total():
    t = fake_trainer()
    assert metrics.add_count(t, "rows_dropped", 3) == 3
    assert metrics.add_count(t, "rows_dropped", 2) == 5
    assert t._metrics["train"]["grpo_patches/rows_dropped"] == [5.0]  # TRL averages a 1-element list
    t._metrics["train"].clear()  # what GRPOTrainer.log does after each log row
    metrics.add_count(t, "rows_dropped", 0)
    assert t._metrics["train"]["grpo_patches/rows_dropped"] == [0.0]
    metrics.add_count(t, "rows_dropped", 4)
    assert t._metrics["train"]["grpo_patches/rows_dropped"] == [4.0]
    assert metrics.count_total(t, "rows_dropped") == 9


def test_report_feeds_status_totals_and_trl_metrics():
    savings.reset("trl")
    t = fake_trainer()
    metrics.report(t, old_logprob_passes_skipped=1, old_logprob_passes_added=0)
    metrics.report(t, old_logprob_passes_skipped=1, old_logprob_passes_added=0)
    assert savings.totals("trl") == {"old_logprob_passes_skipped": 2}
    assert t._metrics["train"]["grpo_patches/old_logprob_passes_skipped"] == [2.0]
    assert t._metrics["train"]["grpo_patches/old_logprob_passes_added"] == [0.0]
    savings.reset("trl")


def test_trainer_without_metrics_dict_is_tolerated():
    t = SimpleNamespace(model=SimpleNamespace(training=True))
    assert metrics.add_count(t, "x") == 1


def test_args_view_overrides_only_gradient_accumulation_steps():
    args = SimpleNamespace(gradient_accumulation_steps=3, steps_per_generation=2)
    view = old_logprobs._ArgsView(args, 5)
    assert view.gradient_accumulation_steps == 5 and view.steps_per_generation == 2
    assert args.gradient_accumulation_steps == 3
    assert isinstance(view, SimpleNamespace)  # isinstance checks in TRL still pass


def stand_in(ga=3, spg=2, iters=1, step=0, window=3, global_step=0, max_steps=10, loader_len=8):
    state = SimpleNamespace(global_step=global_step, max_steps=max_steps)
    return SimpleNamespace(
        args=SimpleNamespace(gradient_accumulation_steps=ga, steps_per_generation=spg),
        num_iterations=iters, _step=step, state=state, current_gradient_accumulation_steps=window,
        callback_handler=SimpleNamespace(train_dataloader=list(range(loader_len))), use_vllm=False,
    )


@pytest.mark.parametrize(
    ("index", "window", "expected"),
    [(0, 3, False), (1, 3, False), (2, 3, True), (0, 2, False), (1, 2, True)],
)
def test_decision_counts_the_real_window(index, window, expected):
    t = stand_in(window=window)
    for _ in range(index):  # micro-steps already done in this window
        accumulation_window.training_step(lambda: None, t, (), {})
    d = old_logprobs.decide(t)
    assert d.compute is expected and d.upstream is True and d.window_steps_left == window - index


def test_window_count_restarts_after_an_optimizer_step_and_a_new_state():
    t = stand_in()
    accumulation_window.training_step(lambda: None, t, (), {})
    assert accumulation_window.window_index(t) == 1
    t.state.global_step += 1
    assert accumulation_window.window_index(t) == 0
    accumulation_window.training_step(lambda: None, t, (), {})
    t.state = SimpleNamespace(global_step=t.state.global_step, max_steps=10)  # train() again / resume
    assert accumulation_window.window_index(t) == 0


def test_consumptions_are_capped_at_the_end_of_training():
    t = stand_in(global_step=9, max_steps=10)  # the last window: nothing consumes after it
    for _ in range(2):
        accumulation_window.training_step(lambda: None, t, (), {})
    d = old_logprobs.decide(t)
    assert (d.consumptions_left, d.window_steps_left, d.compute) == (1, 1, False)


def test_importance_sampling_always_recomputes():
    t = stand_in()
    t.use_vllm, t.vllm_importance_sampling_correction = True, True
    assert old_logprobs.decide(t).compute is True


@pytest.mark.parametrize(("global_step", "expected"), [(0, 3), (1, 3), (2, 2), (3, 3), (5, 2)])
def test_window_length_without_current_gradient_accumulation_steps(global_step, expected):
    """transformers < ~4.54 has no current_gradient_accumulation_steps: epochs of 8 micro-steps
    with GA=3 are cut into windows 3, 3, 2."""
    t = stand_in(global_step=global_step)
    del t.current_gradient_accumulation_steps
    assert accumulation_window.window_length(t, 3) == expected
