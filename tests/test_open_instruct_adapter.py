"""The open-instruct adapter without open-instruct: its version read from a checkout, the tiled
per-token log-probs against dense autograd, the zero-advantage plan and the output-layer checks.
(The adapter on open-instruct's real learners: tests/compat_open_instruct/.)"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import grpo_patches
from grpo_patches import registry
from grpo_patches.adapters.open_instruct import lm_heads, loss_modes, version, zero_advantage
from grpo_patches.adapters.open_instruct.state import StepState
from grpo_patches.adapters.open_instruct.tiled_logprobs import tiled_logprobs
from grpo_patches.errors import UnsupportedFrameworkError

FRAMEWORK = "open_instruct"


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """An importable ``open_instruct`` package made of the given files (no open-instruct code)."""
    def make(files: dict[str, str]) -> Path:
        package = tmp_path / FRAMEWORK
        package.mkdir()
        (package / "__init__.py").write_text("")
        for name, text in files.items():
            (package / name).write_text(text)
        monkeypatch.syspath_prepend(str(tmp_path))
        importlib.invalidate_caches()
        version._detect.cache_clear()
        return package

    yield make
    version._detect.cache_clear()
    sys.modules.pop(FRAMEWORK, None)


@pytest.mark.parametrize(("files", "expected", "said"), [
    ({"olmo_core_hybrid.py": "", "grpo_utils.py": "def resolve_old_logprob(\n"}, "0.3.1.dev0", "olmo_core_hybrid.py"),
    ({"grpo_utils.py": "def resolve_old_logprob(\n"}, "0.3.0", "resolve_old_logprob"),
    ({"_version.py": "__version__ = version = '0.3.1.dev12+g1234'\n"}, "0.3.1.dev12+g1234", "setuptools_scm"),
])
def test_the_version_is_read_from_the_checkout(checkout, files, expected, said):
    checkout(files)
    entry = grpo_patches.status()[FRAMEWORK]
    assert entry["installed"] == expected and entry["supported"], entry
    assert said in entry["version_origin"]


def test_a_checkout_older_than_v030_is_one_clear_error(checkout):
    checkout({"grpo_utils.py": "def compute_grpo_loss(\n"})  # v0.2.0 has no resolve_old_logprob
    with pytest.raises(UnsupportedFrameworkError, match=r"open_instruct 0\.2\.0 is outside the supported range"):
        grpo_patches.enable(FRAMEWORK)


def test_not_importable_means_not_installed():
    assert FRAMEWORK in registry.BUILTIN
    assert registry.get(FRAMEWORK).installed_version() is None
    with pytest.raises(UnsupportedFrameworkError, match="open-instruct is not on PyPI: run from a clone"):
        grpo_patches.enable(FRAMEWORK)


# --- the tiled per-token log-probs ------------------------------------------------------------------

def _dense(hidden, weight, bias, labels, temperature):
    logits = (hidden @ weight.T + (bias if bias is not None else 0)) / temperature
    logps = torch.log_softmax(logits.float(), -1)
    return logps.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logps.exp() * logps).sum(-1)


@pytest.mark.parametrize("with_bias", [False, True])
def test_tiled_logprobs_match_dense_autograd(with_bias, record_property):
    """Values, entropies and the gradient of a loss of the log-probs (hidden, weight, bias), fp32."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 7, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    bias = torch.randn(50, requires_grad=True) if with_bias else None
    labels = torch.randint(0, 50, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, :3] = False  # a prompt: not computed, its gradient never asked for
    probe = torch.randn(2, 7) * mask
    out = SimpleNamespace(entropy=None)
    logps = tiled_logprobs(hidden, weight, bias, labels, mask, 0.7, 3, out)
    (probe * logps).sum().backward()
    tiled = [t.grad.clone() for t in (hidden, weight, bias) if t is not None]
    for t in (hidden, weight, bias):
        if t is not None:
            t.grad = None
    dense, entropy = _dense(hidden, weight, bias, labels, 0.7)
    (probe * dense).sum().backward()
    assert torch.allclose(logps[mask], dense[mask], rtol=0, atol=1e-5)
    assert torch.equal(logps[~mask], torch.zeros_like(logps[~mask]))
    assert torch.allclose(out.entropy[mask], entropy[mask].detach(), rtol=0, atol=1e-5)
    worst = max(float((a - t.grad).norm() / t.grad.norm()) for a, t in zip(tiled, [x for x in (hidden, weight, bias)
                                                                                    if x is not None]))
    record_property("exact_tiled_logprobs_grad_rel", worst)
    assert worst <= 1e-6


def test_a_wrong_temperature_fails_the_comparison(record_property):
    """The planted fault: the tiled log-probs at another temperature are caught by the same comparison."""
    torch.manual_seed(1)
    hidden, weight = torch.randn(1, 5, 8), torch.randn(30, 8)
    labels, mask = torch.randint(0, 30, (1, 5)), torch.ones(1, 5, dtype=torch.bool)
    wrong = tiled_logprobs(hidden, weight, None, labels, mask, 1.0, None, SimpleNamespace())
    dense, _ = _dense(hidden, weight, None, labels, 0.7)
    distance = float((wrong - dense).abs().max())
    record_property("fault_tiled_temperature", distance)
    assert distance > 1e-3


def test_a_zero_incoming_gradient_recomputes_nothing():
    hidden = torch.randn(1, 4, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    logps = tiled_logprobs(hidden, weight, None, torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.bool),
                           1.0, None, SimpleNamespace())
    (logps * 0).sum().backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden)) and torch.equal(weight.grad, torch.zeros_like(weight))


# --- the zero-advantage plan ------------------------------------------------------------------------

@dataclass
class _Batch:
    """What the plan reads of open-instruct's CollatedBatchData."""

    query_responses: list
    advantages: list
    response_masks: list


def _step(advantage_rows: list[float], epochs: int, accumulation: int) -> StepState:
    rows = [torch.tensor([[0.0, a, a, 0.0]]) for a in advantage_rows]
    masks = [torch.tensor([[False, True, True, False]]) for _ in advantage_rows]
    batch = _Batch([torch.zeros(1, 4, dtype=torch.long) for _ in rows], rows, masks)
    return StepState(learner=None, data=batch, accumulation_steps=accumulation, epochs=epochs, index={})


def test_the_plan_drops_zero_micro_batches_and_keeps_one_per_group():
    step = _step([0.0, 1.0, 0.0, 0.0, 0.0, 0.0], epochs=2, accumulation=3)
    plan = zero_advantage.plan(SimpleNamespace(dp_group=None), step)
    assert plan.useful == [False, True, False, False, False, False]
    # per epoch: group 0 runs its useful micro-batch 1 only; group 1 (all zero) runs its first, the boundary there
    assert plan.runs == [False, True, False, True, False, False] * 2
    assert plan.last_backward == [False, True, False, True, False, False] * 2
    assert plan.tokens_dropped == 2 * 4 * 2


def test_a_nan_advantage_is_never_dropped():
    plan = zero_advantage.plan(SimpleNamespace(dp_group=None), _step([float("nan"), 0.0], epochs=1, accumulation=2))
    assert plan.useful == [True, False] and plan.runs == [True, False]


def test_the_kl_term_and_unknown_losses_keep_the_filter_off():
    args = SimpleNamespace(load_ref_policy=True, beta=0.05, loss_fn="dapo")
    learner = SimpleNamespace(args=args, line="deepspeed")
    assert loss_modes.filter_terms(learner)[0].value == 0.05
    args.beta = 0.0
    assert loss_modes.filter_terms(learner)[0].value == 0.0  # 0 * kl: exactly no gradient
    assert loss_modes.unsupported_loss(SimpleNamespace(loss_fn="gspo"))
    assert not loss_modes.unsupported_loss(SimpleNamespace(loss_fn="cispo"))


# --- the output layer -------------------------------------------------------------------------------

def test_the_output_layer_checks():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert lm_heads.problems(model) == []

    class LoraLike(torch.nn.Linear):
        def forward(self, x):  # a replaced lm-head computes something else than hidden @ weight.T
            return super().forward(x) * 2

    model.lm_head = LoraLike(16, 40, bias=False)
    assert "not a plain nn.Linear" in lm_heads.problems(model)[0]
    model.config.model_type = "gemma2"
    assert any("model_type='gemma2'" in p for p in lm_heads.problems(model))


# --- the compat tests' run comparison ----------------------------------------------------------------

def test_the_run_comparison_names_each_gap_and_fails_on_a_nan_run():
    """``distance`` is the largest of ``gaps``; a run that ended in NaN gives NaN (max() over the gaps
    would skip it and call the run exact), so that neither an exactness bound nor a fault's holds."""
    from tests.helpers.open_instruct_compare import distance, gaps

    def run(norms, weights):
        return SimpleNamespace(grad_norms=norms, snapshots=[], gradients=[], weights={"w": torch.tensor(weights)})

    base, off = run([2.0, 1.0], [1.0, 2.0]), run([2.0, 1.001], [1.0, 2.0])
    found = gaps(off, base)
    assert list(found) == ["grad_norm 1", "grad_norm 2", "weights"]
    assert found["grad_norm 2"] == pytest.approx(1e-3) == distance(off, base)
    gap = distance(run([2.0, 1.0], [float("nan"), 2.0]), base)
    assert not gap <= 1e-5 and not gap > 1e-3
