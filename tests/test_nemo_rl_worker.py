"""The NeMo-RL adapter in the DTensor policy worker, on the stand-in of every tag (:mod:`tests.helpers.nemo_fake`).

The same cases run against the real NeMo-RL source in the compat cells (``tests/compat_nemo_rl``).
"""

from __future__ import annotations

import pytest

from tests.helpers import nemo_trim_cases as trim_cases
from tests.helpers import nemo_worker_cases as cases
from tests.helpers.nemo_fake import TAGS
from tests.helpers.nemo_worker_harness import fake_worker

NEW = [t for t in TAGS if t != "v0.5.0"]


@pytest.mark.parametrize("case", sorted(cases.FILTER_CASES))
@pytest.mark.parametrize("tag", TAGS)
def test_filter_matches_upstream(fake_nemo, tag, case, record_property):
    fake_nemo(tag)
    cases.filter_matches_upstream(tag, fake_worker, case, record_property)


@pytest.mark.parametrize("tag", TAGS)
def test_kept_rows_metrics_are_kept_row_means(fake_nemo, tag):
    fake_nemo(tag)
    cases.kept_rows_metrics_are_kept_row_means(tag, fake_worker)


@pytest.mark.parametrize("tag", NEW)
def test_dropped_rows_metrics_are_upstream_metrics(fake_nemo, tag, record_property):
    fake_nemo(tag)
    cases.dropped_rows_metrics_are_upstream_metrics(tag, fake_worker, record_property)


@pytest.mark.parametrize("tag", TAGS)
def test_filter_refuses_or_steps_aside(fake_nemo, tag):
    fake_nemo(tag)
    cases.filter_refuses_or_steps_aside(tag, fake_worker)


@pytest.mark.parametrize("tag", ["v0.7.0", "main"])
def test_filter_steps_aside_for_the_nll_term(fake_nemo, tag):
    fake_nemo(tag)
    cases.filter_steps_aside_for_the_nll_term(tag, fake_worker)


@pytest.mark.parametrize("tag", TAGS)
def test_eval_mode_and_logprobs_see_every_row(fake_nemo, tag):
    fake_nemo(tag)
    cases.eval_mode_and_logprobs_see_every_row(tag, fake_worker)


@pytest.mark.parametrize("tag", TAGS)
def test_on_policy_prev_equals_a_real_pass(fake_nemo, tag, record_property):
    fake_nemo(tag)
    cases.on_policy_prev_equals_a_real_pass(tag, fake_worker, record_property)


@pytest.mark.parametrize("case", sorted(cases.TILED_CASES))
@pytest.mark.parametrize("tag", NEW)
def test_tiled_matches_upstream(fake_nemo, tag, case, record_property):
    fake_nemo(tag)
    cases.tiled_matches_upstream(tag, fake_worker, case, record_property)


@pytest.mark.parametrize("tag", NEW)
def test_tiled_with_the_filter(fake_nemo, tag, record_property):
    fake_nemo(tag)
    cases.tiled_matches_upstream(tag, fake_worker, "token-level", record_property, with_filter=True)


@pytest.mark.parametrize("tag", NEW)
def test_tiled_refuses_or_steps_aside(fake_nemo, tag):
    fake_nemo(tag)
    cases.tiled_refuses_or_steps_aside(tag, fake_worker)


def test_v050_filter_acts_only_inside_the_v2_workers_train(fake_nemo):
    """v0.5.0's filter wraps ``BatchedDataDict`` (shared by every worker): another worker's
    ``train()`` with a policy-gradient loss must still get every row."""
    import grpo_patches
    from tests.helpers.nemo_worker_harness import batched, make_batch, make_loss

    fake_nemo("v0.5.0")
    grpo_patches.enable("nemo_rl", zero_advantage_filter=True)
    worker, loss_fn, batch = fake_worker("v0.5.0", 12, 4), make_loss("v0.5.0"), batched(make_batch())

    def train(self, loss_fn, batch):  # a train() defined outside dtensor_policy_worker_v2.py
        eval_mode, num_global_batches = False, 1  # noqa: F841  (what the v2 worker's frame holds)
        return list(batch.make_microbatch_iterator(4))

    assert sum(mb.size for mb in train(worker, loss_fn, batch)) == 12


@pytest.mark.parametrize("tag", NEW)
def test_a_train_call_that_raised_leaves_no_filter_behind(fake_nemo, tag):
    """The worker's train call is found from inside it (Ray ships its methods frozen, so nothing
    wraps the whole call): one that raised never ended, yet a later ``get_logprobs`` sees every row."""
    import grpo_patches
    from grpo_patches.adapters.nemo_rl.state import TRAIN
    from tests.helpers.nemo_worker_harness import batched, make_batch, make_loss

    fake_nemo(tag)
    grpo_patches.enable("nemo_rl", zero_advantage_filter=True)
    try:
        worker = fake_worker(tag, 12, 4)
        forward = worker.model.forward

        def out_of_memory(*args, **kwargs):
            raise RuntimeError("out of memory")

        worker.model.forward = out_of_memory
        with pytest.raises(RuntimeError, match="out of memory"):
            worker.train(batched(make_batch()), make_loss(tag))
        assert TRAIN.current() is not None and TRAIN.current().filter_on  # left behind by the failed call
        worker.model.forward = forward
        rows = []
        worker.model.register_forward_pre_hook(lambda module, args, kwargs: rows.append(kwargs["input_ids"].shape[0]),
                                               with_kwargs=True)
        assert worker.get_logprobs(batched(make_batch()))["logprobs"].shape[0] == 12 and sum(rows) == 12
    finally:
        grpo_patches.disable("nemo_rl")


@pytest.mark.parametrize("multiple", [1, 4])
@pytest.mark.parametrize("tag", TAGS)
def test_kept_microbatches_are_trimmed(fake_nemo, tag, multiple, record_property):
    fake_nemo(tag)
    trim_cases.kept_microbatches_are_trimmed(tag, fake_worker, record_property, multiple)


@pytest.mark.parametrize("tag", TAGS)
def test_one_column_too_many_is_caught(fake_nemo, tag):
    fake_nemo(tag)
    trim_cases.one_column_too_many_is_caught(tag, fake_worker)


@pytest.mark.parametrize("multiple", [1, 4])
@pytest.mark.parametrize("tag", TAGS)
def test_dynamic_microbatches_are_trimmed(fake_nemo, tag, multiple, record_property):
    fake_nemo(tag)
    trim_cases.kept_microbatches_are_trimmed(tag, fake_worker, record_property, multiple, dynamic=True)
