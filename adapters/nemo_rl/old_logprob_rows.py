"""The prev-logprob pass on only the rows some loss will read (driver side, option ``recompute``).

With several optimizer steps per rollout batch (``train_global_batch_size`` < the batch),
NeMo-RL computes ``prev_logprobs`` for every row. Two kinds of rows never need that pass:

* the rows of the first optimizer step. ``Policy.train`` cuts the batch into chunks of
  ``train_global_batch_size`` rows *in the order it gets them* before anything else
  (``BatchedDataDict.shard_by_batch_size``: dynamic batching sorts, and sequence packing
  packs, only inside a chunk; each data-parallel rank gets its share of every chunk), and the
  worker trains chunk ``i`` as optimizer step ``i``. So rows ``[0, gbs)`` are consumed before
  any optimizer step: their prev log-probs are the detached current ones. No shuffle.
* with the zero-advantage filter on (and ``dropped_rows_metrics=False``): rows whose advantage
  is exactly 0; the filter leaves them out of every loss call, and nothing else reads their
  prev log-probs (the filter runs only when no KL / entropy / NLL term would).

``grpo_train`` computes the advantages after the pass (v0.6.0+), so the pass is deferred:
at its usual place it is skipped as on a one-step batch (:mod:`.old_logprobs`), and here, at
``Policy.train`` (same weights: nothing trained in between, and the advantages exist), it
runs with NeMo-RL's own ``Policy.get_logprobs`` on the other rows only. The skipped rows hold
NaN and a per-row mark (:data:`~.placeholders.MARK`: ``FIRST`` or ``ZERO``); the patched loss in
the workers puts the detached current log-probs in their place (:mod:`.placeholders`), and
raises if one would be read otherwise. Saved: ``grpo_patches/old_logprob_rows_skipped``.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.row_merge import merge_rows, round_up

from . import FRAMEWORK, PACKAGE, pass_bracket
from .calls import loss_tensors, setting
from .loss_modes import denominator, gradient_terms
from .placeholders import FIRST, MARK, ZERO
from .state import VERIFY_PREV, LoopCall
#: What ``grpo_train`` puts into ``train_data``; any other key (multimodal inputs) stops the deferral.
KNOWN_KEYS = {"input_ids", "input_lengths", "generation_logprobs", "token_mask", "sample_mask", "prev_logprobs",
              "reference_policy_logprobs", "advantages"}
LOGPROB_KEYS = ("input_ids", "input_lengths", "token_mask", "sample_mask")


def why_not(loop: LoopCall) -> str | None:
    """Why the row-subset pass cannot be exact for this loop (``None``: it can)."""
    from .driver_setup import workers_reached

    if not FRAMEWORK.on("recompute"):
        return "recompute=False (NeMo-RL's own behaviour: every row)"
    reached, why = workers_reached()
    if not reached:
        return f"the Ray workers are not patched ({why}): their loss would read the skipped rows"
    if setting(loop.config, "policy.sequence_packing.enabled", False):
        return "policy.sequence_packing.enabled (not covered yet)"
    if setting(loop.config, "policy.megatron_cfg.enabled", False):
        return _megatron_problem(loop.config)
    return None


def _megatron_problem(config: Any) -> str | None:
    """Why the cut pass is not covered with this Megatron policy (``None``: v0.7.x's worker, whose loss
    calls are patched, with the layout proven on it: no tensor / pipeline / context parallelism, no
    dynamic batching)."""
    from packaging.version import Version

    from .version import read_version

    found = read_version(PACKAGE) or "0"
    if not Version("0.7.0") <= Version(found) < Version("0.8.0.dev0"):
        return f"NeMo-RL {found}'s Megatron policy worker (covered on v0.7.x only)"
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        if int(setting(config, f"policy.megatron_cfg.{name}", 1) or 1) > 1:
            return f"the Megatron policy worker with policy.megatron_cfg.{name} > 1 (not covered yet)"
    if setting(config, "policy.dynamic_batching.enabled", False):
        return "the Megatron policy worker with policy.dynamic_batching.enabled (not covered yet)"
    return None


def zero_rows_skippable(loss_fn: Any) -> bool:
    """The filter will leave zero-advantage rows out of every loss call (the workers decide the
    same from the same loss object; a row they keep anyway makes the patched loss raise)."""
    from grpo_patches.zero_advantage import filter_problems

    if not FRAMEWORK.on("zero_advantage_filter") or FRAMEWORK.on("dropped_rows_metrics"):
        return False
    try:
        denominator(loss_fn)
        return not filter_problems(gradient_terms(loss_fn))
    except Exception:  # noqa: BLE001 - a setting the filter does not know: it steps aside
        return False


def plan(data: Any, gbs: int, multiple: int, zero_skip: bool) -> tuple[list[int], Any]:
    """``(rows to compute, per-row marks)``: the rows after the first ``gbs`` (with a non-zero
    advantage when ``zero_skip``), padded with skipped rows to a multiple of ``multiple`` (the
    rows NeMo-RL's pass takes: :func:`pass_multiple`)."""
    import torch

    rows = int(data["input_ids"].shape[0])
    marks = torch.zeros(rows, dtype=torch.float32)
    marks[: min(gbs, rows)] = FIRST
    if zero_skip:
        advantages, mask = loss_tensors(data)
        zero = ((advantages != 0) & (mask != 0)).sum(dim=1) == 0
        marks[gbs:][zero[gbs:]] = ZERO
    compute = [r for r in range(rows) if marks[r] == 0]
    if compute:  # padded with skipped rows, last first, as far as there are any: computed after all, marks gone
        spare = [r for r in reversed(range(rows)) if marks[r] != 0]
        compute += spare[:round_up(len(compute), multiple) - len(compute)]
    for r in compute:
        marks[r] = 0.0
    return sorted(compute), marks


def fill(data: Any, gbs: int, multiple: int, zero_skip: bool, logprobs: Callable[[Any], Any]) -> int:
    """Put this batch's prev log-probs into ``data`` (NaN and a mark for the skipped rows).

    :param logprobs: NeMo-RL's pass on a sub-batch (``Policy.get_logprobs(...)["logprobs"]``).
    :returns: the rows whose pass did not run."""
    import torch

    compute, marks = plan(data, gbs, multiple, zero_skip)
    like = data["generation_logprobs"]
    prev = torch.full(tuple(like.shape), float("nan"), dtype=torch.float32)
    if compute:
        values = logprobs(subset(data, compute))
        prev = merge_rows(values.to(prev.device), torch.tensor(compute), int(prev.shape[0]), fill=prev)
    data["prev_logprobs"] = prev
    data[MARK] = marks
    return int(marks.shape[0]) - len(compute)


def subset(data: Any, rows: list[int]) -> Any:
    """The rows of ``data`` that NeMo-RL's pass reads (its own ``logprob_data`` keys)."""
    return type(data)({key: data[key] for key in LOGPROB_KEYS if key in data}).select_indices(rows)


def unknown_keys(data: Any) -> list[str]:
    """Keys of the train data this module does not know how to cut by rows (multimodal inputs)."""
    return sorted(set(data) - KNOWN_KEYS - {MARK})


def pass_multiple(policy: Any) -> int:
    """The row counts NeMo-RL's pass takes: a multiple of the data-parallel ranks (it shards the
    rows evenly), times ``logprob_batch_size`` without dynamic batching (each rank's rows are
    cut into whole micro-batches of that size)."""
    size = getattr(policy, "data_parallel_size", None)
    if size is None:
        annotations = getattr(policy, "sharding_annotations", None)
        size = annotations.get_axis_size("data_parallel") if annotations is not None else 1
    dynamic = setting(policy, "cfg.dynamic_batching.enabled", False)
    return int(size) * (1 if dynamic else int(setting(policy, "cfg.logprob_batch_size", 1) or 1))


def run(loop: LoopCall, policy: Any, data: Any, gbs: int, loss_fn: Any, verify_step: bool) -> tuple[int, Callable[[], None]]:
    """At ``Policy.train`` of a deferred step: the pass on the rows some loss reads.

    On a verify step the pass runs over every row (the workers compare the skipped rows' real
    values with what their loss used, and run NeMo-RL's unpatched computation on them).

    :returns: ``(rows skipped, what puts the batch and the loss back after the call)``."""
    unknown = unknown_keys(data)
    zero_skip = zero_rows_skippable(loss_fn)
    bracket = pass_bracket.needed(loop.config)

    def logprobs(sub: Any) -> Any:
        """NeMo-RL's pass, unpatched (``Policy.get_logprobs``'s record would answer it with the step's
        placeholder); inside ``grpo_train``'s inference bracket only where that frees memory
        (:mod:`.pass_bracket`), then back to training as ``grpo_train`` left the workers."""
        if bracket:
            policy.prepare_for_lp_inference()
        try:
            with FRAMEWORK.unpatched():
                return policy.get_logprobs(sub)["logprobs"]
        finally:
            if bracket:
                policy.prepare_for_training()

    if unknown or verify_step:
        _, marks = plan(data, gbs, pass_multiple(policy), zero_skip)
        every = data if unknown else subset(data, list(range(int(data["input_ids"].shape[0]))))
        data["prev_logprobs"] = logprobs(every)
        data[MARK] = marks * (0.0 if unknown else 1.0)
        skipped = 0
    else:
        skipped = fill(data, gbs, pass_multiple(policy), zero_skip, logprobs)
    if unknown:
        FRAMEWORK.note("old_logprob_pass", f"run on every row: the batch carries {', '.join(unknown)} "
                                           "(multimodal rows are not cut by row yet)")
    elif verify_step:
        setattr(loss_fn, VERIFY_PREV, {"force_on_policy_ratio": loss_fn.__dict__.get("force_on_policy_ratio")})
    else:
        FRAMEWORK.note("old_logprob_pass", "deferred to Policy.train and run only on the rows some loss reads (not "
                                           "the first optimizer step's" + (", not those with advantage 0" if zero_skip
                                                                           else "") + "), "
                       + (f"in NeMo-RL's inference bracket ({bracket})" if bracket else
                          "without NeMo-RL's inference bracket (the workers set eval mode themselves)"))

    def restore() -> None:
        data.pop(MARK, None)
        loss_fn.__dict__.pop(VERIFY_PREV, None)

    return skipped, restore
