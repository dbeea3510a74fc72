"""NeMo-RL's Megatron policy worker: where the zero-advantage filter runs, and the notes where it does not.

On each tag's stand-in (:mod:`tests.helpers.nemo_fake`), ``grpo.setup`` with ``policy.megatron_cfg.enabled``:
on v0.6.0, v0.7.0 and main the worker is patched (the filter decides there, per train call; proven on the real worker
in ``tests/compat_nemo_rl/test_real_megatron_filter.py``), so setup says nothing; on the other tags
``"auto"`` notes in ``status()`` why that tag's worker is not patched and ``True`` raises before
training; a DTensor policy gets no note. The Megatron settings the worker-side filter does not cover
yet are listed by :func:`~grpo_patches.adapters.nemo_rl.zero_advantage_megatron.problems`.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
from packaging.version import Version

import grpo_patches
from grpo_patches.adapters.nemo_rl import PATCHES
from grpo_patches.adapters.nemo_rl.zero_advantage_megatron import problems
from grpo_patches.errors import IncompatibleOptionsError
from tests.helpers import nemo_fake
from tests.helpers.nemo_fixtures import fake_nemo  # noqa: F401  (fixture)

MEGATRON = "nemo_rl.models.policy.workers.megatron_policy_worker"


def _setup(tag: str, megatron: bool):
    grpo = importlib.import_module("nemo_rl.algorithms.grpo")
    tiny = importlib.import_module("nemo_rl.models.tiny").TinyLM
    config = nemo_fake.master_config(tag, policy={"model_factory": tiny, "megatron_cfg": {"enabled": megatron}})
    return grpo.setup(config, None, None, None)


PATCHED_TAGS = ("v0.6.0", "v0.7.0", "main")


@pytest.mark.parametrize("tag", [t for t in nemo_fake.TAGS if t not in PATCHED_TAGS])
def test_unpatched_tags_auto_notes_and_true_refuses(fake_nemo, tag):  # noqa: F811
    fake_nemo(tag)
    grpo_patches.enable("nemo_rl", zero_advantage_filter="auto")
    _setup(tag, megatron=False)
    assert "Megatron" not in str(grpo_patches.status()["nemo_rl"]["notes"].get("zero_advantage_filter"))
    _setup(tag, megatron=True)
    note = grpo_patches.status()["nemo_rl"]["notes"]["zero_advantage_filter"]
    assert note.startswith("off: NeMo-RL ") and "Megatron worker is not patched" in note, note
    assert "v0.6.0+'s Megatron worker" in note, note
    grpo_patches.disable("nemo_rl")
    grpo_patches.enable("nemo_rl", zero_advantage_filter=True)
    with pytest.raises(IncompatibleOptionsError, match="Megatron worker is not patched"):
        _setup(tag, megatron=True)


@pytest.mark.parametrize("tag", PATCHED_TAGS)
def test_patched_tags_setup_leaves_the_decision_to_the_worker(fake_nemo, tag):  # noqa: F811
    fake_nemo(tag)
    grpo_patches.enable("nemo_rl", zero_advantage_filter=True)
    _setup(tag, megatron=True)  # no error: the patched worker decides per train call
    assert "Megatron" not in str(grpo_patches.status()["nemo_rl"]["notes"].get("zero_advantage_filter"))


def test_megatron_worker_records_are_v060_and_up():
    records = [t for t in PATCHES if t.module == MEGATRON]
    assert {t.attribute for t in records} == {"process_global_batch", "get_microbatch_iterator",
                                              "aggregate_training_statistics"}
    for target in records:  # the train call's brackets whatever the options (the deferred pass's rows need it)
        expected = "zero_advantage_filter" if target.attribute == "get_microbatch_iterator" else None
        assert target.option == expected and target.pickle_by_reference
        assert [v for v in ("0.5.0", "0.6.0", "0.7.0", "0.8.0.dev0") if target.applies_to(Version(v))] == \
            ["0.6.0", "0.7.0", "0.8.0.dev0"]


def _cfg(**megatron):
    return {"megatron_cfg": {"pipeline_model_parallel_size": 1, "context_parallel_size": 1, **megatron},
            "dynamic_batching": {"enabled": False}, "sequence_packing": {"enabled": False}}


def test_problems_name_each_uncovered_setting():
    model = SimpleNamespace(mtp_num_layers=None)
    assert problems(_cfg(), model, False) == []
    assert problems(_cfg(pipeline_model_parallel_size=2, tensor_model_parallel_size=2), model, False) == []
    vpp = _cfg(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert "virtual_pipeline_model_parallel_size" in problems(vpp, model, False)[0]
    assert "context_parallel_size" in problems(_cfg(context_parallel_size=2), model, False)[0]
    dynamic = {**_cfg(), "dynamic_batching": {"enabled": True}}
    assert "dynamic_batching" in problems(dynamic, model, False)[0]
    assert "dropped_rows_metrics=False" in problems(_cfg(), model, True)[0]
    assert "mtp_num_layers" in problems(_cfg(), SimpleNamespace(mtp_num_layers=1), False)[0]
    assert "draft" in problems({**_cfg(), "draft": {"enabled": True}}, model, False)[0]


SPLIT_STEP = '''
def _train_microbatch_body(self, state, data):
    return wrapper(lambda *a, **k: "unfiltered", None, (data,), {})
'''


def _split_step_body():
    """A stand-in of main's ``MegatronPolicyWorkerImpl._train_microbatch_body`` (same name, same file name)
    calling the filter's ``get_microbatch_iterator`` wrapper, as main's split train step does."""
    from grpo_patches.adapters.nemo_rl.zero_advantage_megatron import get_microbatch_iterator

    namespace = {"wrapper": get_microbatch_iterator}
    exec(compile(SPLIT_STEP, "nemo_rl/models/policy/workers/megatron_policy_worker.py", "exec"), namespace)
    return namespace["_train_microbatch_body"]


def test_main_split_train_step_runs_unfiltered_and_says_so(fake_nemo):  # noqa: F811
    fake_nemo("main")
    loss_fn = type("ClippedPGLossFn", (), {})()
    body, worker = _split_step_body(), SimpleNamespace()
    grpo_patches.enable("nemo_rl", zero_advantage_filter="auto")
    assert body(worker, {"loss_fn": loss_fn}, {}) == "unfiltered"
    note = grpo_patches.status()["nemo_rl"]["notes"]["zero_advantage_filter"]
    assert "split train step" in note and "unfiltered" in note, note
    grpo_patches.disable("nemo_rl")
    grpo_patches.enable("nemo_rl", zero_advantage_filter=True)
    with pytest.raises(IncompatibleOptionsError, match="split train step"):
        body(worker, {"loss_fn": loss_fn}, {})
    grpo_patches.disable("nemo_rl")
    grpo_patches.enable("nemo_rl", zero_advantage_filter=False)
    assert body(worker, {"loss_fn": loss_fn}, {}) == "unfiltered"  # off: nothing to say
