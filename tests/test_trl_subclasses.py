"""GRPOTrainer subclasses: TRL's GMPOTrainer (its own ``_compute_loss``) and users' subclasses.

A patch that wraps a method a subclass overrides never runs for it, and one that reproduces a
loss would reproduce the wrong one. Checked here: the zero-advantage filter runs exactly for
GMPO (its objective is known), the tiled loss refuses GMPO (``True``) or leaves it on TRL's
path (``"auto"``), an unknown ``_compute_loss`` or policy forward switches the loss patches
off for that class, an overridden ``training_step`` switches the exact recompute and
``pack_kept_rows`` off, and ``status()`` says per trainer class what ran. Tolerances as in ``test_trl_filter``.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("trl")

from packaging.version import Version  # noqa: E402

from grpo_patches.demo import tiny_model  # noqa: E402
from grpo_patches.errors import IncompatibleOptionsError  # noqa: E402
from tests.helpers.trl_runs import EXACT_METRICS, assert_same_metrics, gmpo_class  # noqa: E402
from grpo_patches_testing.trl_train import train  # noqa: E402

COMMON = dict(steps=3, reward_funcs=tiny_model.reward_constant_per_prompt, bf16=False, optim="sgd",
              count_forwards=True)
ONLY_FILTER = dict(recompute=False, logprob_skip=False, tiled_loss=False, zero_advantage_filter=True)
GRPO_CLASS = "trl.trainer.grpo_trainer.GRPOTrainer"


_gmpo = gmpo_class


def _user_classes() -> dict[str, type]:
    """Subclasses a user might write; each overrides one method the patches depend on."""
    from trl import GRPOTrainer

    class ScaledLoss(GRPOTrainer):
        def _compute_loss(self, model, inputs):  # an objective grpo_patches does not know
            return 1.5 * super()._compute_loss(model, inputs)

    class OwnForward(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    class OwnTrainingStep(GRPOTrainer):
        def training_step(self, *args, **kwargs):
            return super().training_step(*args, **kwargs)

    return {c.__name__: c for c in (ScaledLoss, OwnForward, OwnTrainingStep)}


USER = functools.lru_cache(maxsize=None)(_user_classes)


def qualified(klass: type) -> str:
    return f"{klass.__module__}.{klass.__qualname__}"


@functools.lru_cache(maxsize=None)
def run(klass_name: str, options: tuple = (), **config):
    klass = _gmpo() if klass_name == "GMPOTrainer" else USER()[klass_name]
    patched = bool(options)
    return train(patched, dict(options) if patched else None, trainer_class=klass, **{**COMMON, **config})


def test_gmpo_gets_the_filter_exactly():
    ref, got = run("GMPOTrainer"), run("GMPOTrainer", tuple(ONLY_FILTER.items()))
    saved = got.savings
    assert saved["rows_dropped"] > 0 and saved["forward_rows_skipped"] == saved["rows_dropped"]
    assert got.forwards.with_grad == ref.forwards.with_grad - saved["rows_dropped"]
    assert ref.max_weight_diff(got) < 1e-6
    assert_same_metrics(ref, got, names=EXACT_METRICS)
    assert got.metrics("entropy/kept_rows") and not got.metrics("entropy")
    note = got.notes(qualified(_gmpo()))["zero_advantage_filter"]
    assert note.startswith("on (gmpo objective)")


def _tiled_available() -> bool:
    import trl

    return Version(trl.__version__) >= Version("1.16")


@pytest.mark.skipif(not _tiled_available(), reason="the tiled-loss adapter needs TRL 1.16")
def test_gmpo_tiled_true_refuses_and_auto_keeps_gmpos_loss():
    gmpo = _gmpo()
    built: list = []
    with pytest.raises(IncompatibleOptionsError, match=r"tiled_loss=True.*GMPOTrainer\._compute_loss"):
        train(True, dict(ONLY_FILTER, tiled_loss=True), steps=1, trainer_class=gmpo, trainer_hook=built.append)
    assert built == []
    ref = run("GMPOTrainer")
    auto = run("GMPOTrainer", (("tiled_loss", "auto"), ("zero_advantage_filter", False),
                               ("recompute", False), ("logprob_skip", False)))
    assert ref.same_weights(auto)  # TRL's (GMPO's) own loss path, untouched: bitwise
    note = auto.notes(qualified(gmpo))["tiled_loss"]
    assert note.startswith("off: ") and "GMPOTrainer._compute_loss" in note  # TRL's own loss path runs


@pytest.mark.parametrize("klass_name", ["ScaledLoss", "OwnForward"])
def test_an_unknown_loss_or_forward_switches_the_loss_patches_off(klass_name):
    klass = USER()[klass_name]
    ref = run(klass_name)
    auto = run(klass_name, (("zero_advantage_filter", "auto"), ("recompute", False), ("logprob_skip", False)))
    assert ref.same_weights(auto)
    assert "rows_dropped" not in auto.savings and auto.forwards.with_grad == ref.forwards.with_grad
    note = auto.notes(qualified(klass))["zero_advantage_filter"]
    assert note.startswith("off:") and klass_name in note
    built: list = []
    with pytest.raises(IncompatibleOptionsError, match=f"zero_advantage_filter=True.*{klass_name}"):
        train(True, ONLY_FILTER, steps=1, trainer_class=klass, trainer_hook=built.append)
    assert built == []


def test_an_overridden_training_step_leaves_the_recompute_to_trl():
    klass = USER()["OwnTrainingStep"]
    ref = run("OwnTrainingStep", reward_funcs=tiny_model.reward_char_sum)
    got = run("OwnTrainingStep", (("zero_advantage_filter", False),), reward_funcs=tiny_model.reward_char_sum)
    assert ref.same_weights(got)
    assert "old_logprob_passes_skipped" not in got.savings
    assert got.forwards.no_grad == ref.forwards.no_grad  # TRL's own old-logprob passes, all of them
    note = got.notes(qualified(klass))["old_logprob_pass"]
    assert note.startswith("TRL's own rule") and "OwnTrainingStep.training_step" in note



def test_a_subclass_overriding_what_packing_deals_for_is_not_packed():
    klass = USER()["OwnTrainingStep"]
    window = dict(gradient_accumulation_steps=4, steps_per_generation=4, per_device_train_batch_size=2,
                  num_prompts=8, loss_type="grpo")
    filtered = run("OwnTrainingStep", tuple(ONLY_FILTER.items()), **window)
    auto = run("OwnTrainingStep", tuple(dict(ONLY_FILTER, pack_kept_rows="auto").items()), **window)
    assert filtered.same_weights(auto)
    assert auto.forwards.with_grad == filtered.forwards.with_grad  # TRL's micro-batches, not re-dealt ones
    note = auto.notes(qualified(klass))["pack_kept_rows"]
    assert note.startswith("off") and "OwnTrainingStep.training_step" in note
    built: list = []
    with pytest.raises(IncompatibleOptionsError, match="pack_kept_rows=True.*OwnTrainingStep"):
        train(True, dict(ONLY_FILTER, pack_kept_rows=True), trainer_class=klass, trainer_hook=built.append,
              **{**COMMON, **window, "steps": 1})
    assert built == []
