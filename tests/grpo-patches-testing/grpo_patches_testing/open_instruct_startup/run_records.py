"""What an open-instruct end-to-end run leaves for the test to read (observation only: nothing changed).

In the run's folder (``settings()["dump"]``):

* ``metrics.jsonl``: open-instruct's own logged metrics, one line per training step -- the scalar dict
  ``one_training_step`` prints (``print_rich_single_line_metrics``) and would send to wandb;
* ``learner-<pid>.jsonl``: per ``step()`` of each learner process: its metrics as ``step()`` returns them
  (before the driver averages ranks), forwards counted by hooks on the DeepSpeed engines' modules
  (policy with grad: training; policy without grad: the old-logprob pre-pass; the reference model),
  DeepSpeed's grad norm per optimizer step, a digest of the packed batch the learner got, fingerprints
  of the weights each weight sync sent, and ``grpo_patches.status()`` of that process when grpo_patches
  was enabled there;
* ``engine.jsonl``: every rollout the stand-in engine produced (``rollout_engine``).
"""

from __future__ import annotations

import functools
import json
import os
import sys
from typing import Any


def _append(name: str, line: dict[str, Any]) -> None:
    from grpo_patches_testing.open_instruct_startup import cpu_run

    dump = cpu_run.settings().get("dump")
    if dump:
        with open(os.path.join(dump, name), "a") as f:
            f.write(json.dumps(line, default=_plain) + "\n")


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def observe_logged_metrics(model_utils: Any) -> None:
    """``print_rich_single_line_metrics``: the driver prints each training step's scalar metrics with it
    (``grpo_fast`` imports it by name after this hook has run)."""
    original = model_utils.print_rich_single_line_metrics

    @functools.wraps(original)
    def print_rich_single_line_metrics(metrics: dict[str, Any]) -> Any:
        _append("metrics.jsonl", dict(metrics))
        return original(metrics)

    model_utils.print_rich_single_line_metrics = print_rich_single_line_metrics


class LearnerRecord:
    """The current ``step()``'s observations in a learner process (one per process)."""

    def __init__(self) -> None:
        from grpo_patches_testing.open_instruct_cpu import Result

        self.result = Result()
        self.batch: dict[str, Any] = {}
        self.sent_before = 0

    def watch_engine(self, engine: Any, is_policy: bool) -> None:
        """Hooks on a DeepSpeed engine from ``deepspeed.initialize``: the policy's (it has an optimizer)
        or the reference model's."""
        from grpo_patches_testing.open_instruct_cpu import count_forwards

        module = engine.module
        head = module.get_output_embeddings()
        count_forwards(module if is_policy else None, None if is_policy else module, [head], module.config.vocab_size,
                       self.result)
        if is_policy:
            real_norm = engine.get_global_grad_norm

            def get_global_grad_norm(*args: Any, **kwargs: Any) -> Any:
                norm = real_norm(*args, **kwargs)
                self.result.grad_norms.append(float(norm))
                return norm

            engine.get_global_grad_norm = get_global_grad_norm  # step() calls it after each optimizer step

    def see_batch(self, batch: Any) -> None:
        """A digest of the collated batch ``step()`` starts from (``CollatedBatchData.to``); the step's
        counts start here (the weight sync's warm-up forward comes before)."""
        import dataclasses

        from grpo_patches_testing.open_instruct_cpu import Result

        fresh = Result()  # in place: the hooks hold this object
        for f in dataclasses.fields(fresh):
            setattr(self.result, f.name, getattr(fresh, f.name))
        self.batch = {"micro_batches": len(batch.query_responses),
                      "shapes": [list(t.shape) for t in batch.query_responses],
                      "token_sum": int(sum(int(t.sum()) for t in batch.query_responses)),
                      "advantage_sum": float(sum(float(a.double().sum()) for a in batch.advantages)),
                      "zero_advantage": [bool((a[m.bool()] == 0).all())
                                         for a, m in zip(batch.advantages, batch.response_masks)],
                      "vllm_logprob_sum": float(sum(float(v.double().nansum()) for v in batch.vllm_logprobs))}
        self.batch["zero_advantage_micro_batches"] = sum(self.batch["zero_advantage"])

    def end_step(self, metrics: dict[str, float]) -> None:
        from grpo_patches_testing.open_instruct_startup import rollout_engine

        r = self.result
        line = {"pid": os.getpid(), "metrics": metrics, "batch": self.batch, "grad_norms": r.grad_norms,
                "forwards": {"reference": r.ref_forwards, "old_logprob": r.old_logprob_forwards,
                             "training": r.policy_forwards, "training_rows": r.policy_rows,
                             "full_logits": r.full_logits, "largest_logits": list(r.largest_logits)},
                "weight_syncs": rollout_engine.SENT[self.sent_before:], "grpo_patches": _grpo_patches_status()}
        self.sent_before = len(rollout_engine.SENT)
        _append(f"learner-{os.getpid()}.jsonl", line)


#: This process's learner record, once a learner was constructed here.
LEARNER: LearnerRecord | None = None


def _grpo_patches_status() -> Any:
    """``grpo_patches.status()`` where grpo_patches was enabled in this process (never imported here)."""
    if "grpo_patches" not in sys.modules:
        return None
    import grpo_patches

    return grpo_patches.status()


def observe_learner(deepspeed: Any, data_types: Any, utils: Any) -> None:
    """In a learner process: the engines as ``deepspeed.initialize`` returns them, the batch at the top
    of ``step()`` (``data_BT.to(device)``), the end of ``step()`` (``local_metrics.get_metrics_list()``)."""
    global LEARNER
    if LEARNER is not None:
        return
    LEARNER = record = LearnerRecord()
    initialize = deepspeed.initialize

    @functools.wraps(initialize)
    def ds_initialize(*args: Any, **kwargs: Any) -> Any:
        out = initialize(*args, **kwargs)
        record.watch_engine(out[0], is_policy=kwargs.get("optimizer") is not None)
        return out

    deepspeed.initialize = ds_initialize
    to = data_types.CollatedBatchData.to

    @functools.wraps(to)
    def batch_to(self: Any, *args: Any, **kwargs: Any) -> Any:
        record.see_batch(self)
        return to(self, *args, **kwargs)

    data_types.CollatedBatchData.to = batch_to
    get_metrics_list = utils.MetricsTracker.get_metrics_list

    @functools.wraps(get_metrics_list)
    def metrics_list(self: Any) -> dict[str, float]:
        metrics = get_metrics_list(self)
        record.end_step(metrics)
        return metrics

    utils.MetricsTracker.get_metrics_list = metrics_list
