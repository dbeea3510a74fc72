"""TRL comparison runs shared by the TRL test modules: the filter-or-upstream run (cached, so
modules that compare against the same unpatched run train it once), metric comparisons, the
kept-rows spy, and which TRL versions the tiled loss and GMPO tests need.

See ``tests/test_trl_filter.py`` for the tolerances and why SGD.
"""

from __future__ import annotations

import functools
import math

import pytest
from packaging.version import Version

from grpo_patches.demo import tiny_model
from grpo_patches_testing.trl_train import train

ONLY_FILTER = dict(recompute=False, logprob_skip=False, tiled_loss=False)
COMMON = dict(steps=3, reward_funcs=tiny_model.reward_constant_per_prompt, bf16=False, optim="sgd",
              count_forwards=True)
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
#: Metrics the dropped rows cannot change: same name, same value with the default options.
EXACT_METRICS = (
    "loss",
    "grad_norm",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
    "cispo_clip_ratio",
)
#: Metrics computed from the dropped rows' forward: logged as <name>/kept_rows by default.
FORWARD_METRICS = ("entropy", "vespo/phi_seq_mean")
METRICS = (*EXACT_METRICS, *FORWARD_METRICS, "kl")


class KeptRowsSpy:
    """On an unpatched trainer, records every training loss call's advantages, mask, TRL's
    entropies and VESPO weights, to compute the kept-rows metrics independently."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def attach(self, trainer) -> None:
        import torch

        klass = type(trainer)

        def compute_loss(model, inputs):
            record = {"advantages": inputs["advantages"], "mask": inputs["completion_mask"],
                      "step": trainer.state.global_step}
            self.calls.append(record)

            def logps_and_entropies(*args, **kwargs):
                out = klass._get_per_token_logps_and_entropies(trainer, *args, **kwargs)
                if torch.is_grad_enabled():
                    record["entropy"] = out[1].detach()
                return out

            def gamma_weights(*args, **kwargs):
                record["phi"] = klass.get_gamma_weights(*args, **kwargs)
                return record["phi"]

            trainer._get_per_token_logps_and_entropies = logps_and_entropies
            trainer.get_gamma_weights = gamma_weights
            try:
                return klass._compute_loss(trainer, model, inputs)
            finally:
                del trainer._get_per_token_logps_and_entropies, trainer.get_gamma_weights

        trainer._compute_loss = compute_loss

    def _per_step(self, value, total: bool = False) -> list:
        """TRL's logging (logging_steps=1): per optimizer step, the mean of its micro-steps'
        values, NaN skipped (``total``: the sum, for counts)."""
        out = []
        for step in sorted({call["step"] for call in self.calls}):
            values = [value(call) for call in self.calls if call["step"] == step]
            values = [v for v in values if not math.isnan(v)]
            out.append((sum(values) if total else sum(values) / len(values)) if values else None)
        return out

    def kept_rows(self, name: str) -> list:
        def value(call):
            real = (call["advantages"] != 0).nonzero().flatten()
            if name == "entropy":
                mask = call["mask"][real].float()
                count = float(mask.sum())
                return float((call["entropy"][real] * mask).sum()) / count if count else math.nan
            return float(call["phi"][real].mean()) if real.numel() else math.nan

        return self._per_step(value)

    def rows_dropped(self) -> list:
        def value(call):
            rows, real = call["advantages"].numel(), int((call["advantages"] != 0).sum())
            return float(rows - max(real, 1))  # the filter keeps >= 1 row

        return self._per_step(value, total=True)


def verify_figures(result) -> list[dict]:
    """Verify mode's figures (``grpo_patches/verify/<name>``, prefix dropped) of each training log row."""
    from grpo_patches.verify import METRIC_PREFIX

    return [{k[len(METRIC_PREFIX):]: v for k, v in row.items() if k.startswith(METRIC_PREFIX)}
            for row in result.log_history if "loss" in row]


@functools.lru_cache(maxsize=None)
def run(patched: bool, filter_value: object = True, dropped_rows_metrics: bool = False, **config: object):
    if patched:
        options = dict(ONLY_FILTER, zero_advantage_filter=filter_value, dropped_rows_metrics=dropped_rows_metrics)
        return train(True, options, **COMMON, **config)
    spy = KeptRowsSpy()
    result = train(False, None, trainer_hook=spy.attach, **COMMON, **config)
    result.extra["spy"] = spy
    return result


def assert_same_metrics(ref, got, rel: float = 1e-5, names=METRICS) -> None:
    for name in names:
        expected, actual = ref.metrics(name), got.metrics(name)
        assert len(expected) == len(actual), name
        for e, a in zip(expected, actual):
            assert math.isclose(e, a, rel_tol=rel, abs_tol=1e-7), (name, expected, actual)


def assert_close_or_none(expected: list, actual: list) -> None:
    """``expected`` per step, None for a step without kept rows: that step logs no value."""
    present = [e for e in expected if e is not None]
    assert len(present) == len(actual) and all(not math.isnan(a) for a in actual)
    assert all(math.isclose(e, a, rel_tol=1e-5) for e, a in zip(present, actual))


def _tiled_supported() -> bool:
    import trl

    from grpo_patches.adapters.trl import ADAPTER

    return any(t.option == "tiled_loss" for t in ADAPTER.targets(Version(trl.__version__)))


#: Training tests need a TRL whose loss normalisers the tiled adapter reproduces.
needs_tiled = pytest.mark.skipif(not _tiled_supported(), reason="tiled-loss adapter supports TRL 1.16 only")


def gmpo_class() -> type:
    """TRL's GMPOTrainer (skips the test on a TRL without it)."""
    import trl

    if Version(trl.__version__) < Version("1.7"):
        pytest.skip(f"TRL {trl.__version__} has no GMPOTrainer")
    from trl.experimental.gmpo import GMPOTrainer

    return GMPOTrainer
