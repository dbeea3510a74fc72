"""The prev-logprob pass of the synchronous ``grpo_train`` (driver side).

NeMo-RL computes ``prev_logprobs`` with a full forward pass (``policy.get_logprobs``) every
step, unless the user sets ``loss_fn.force_on_policy_ratio`` (v0.7.0+). When the step is
provably on-policy, the pass is skipped here without that setting, and the loss uses the
detached current log-probs instead (the same numbers: no optimizer step separates generation
from the only optimizer step that consumes the batch). Provably on-policy means:

* the synchronous loop (``grpo_train``; ``async_grpo_train`` is off-policy by design);
* one optimizer step per rollout batch: ``num_prompts_per_step * num_generations_per_prompt
  // train_global_batch_size`` is 1 — asked of the ``grpo_recompute_old_logps`` hook (one
  consumption per optimizer step, a window of one), and checked again on every
  ``Policy.train`` call (:mod:`.policy_train`, which runs the pass after all if a call would make
  more optimizer steps);
* nothing else reads the log-probs (``needed_elsewhere``): no importance-sampling correction,
  no ``grpo.seq_logprob_error_threshold``, no advantage estimator that uses them
  (Reinforce++ with ``use_kl_in_reward`` and a KL penalty, on-policy distillation);
* the loss keeps its formula under the substitution: not ``disable_ppo_ratio`` / ``use_cispo``
  (NeMo-RL's own on-policy path changes those losses' reported value);
* the zero placeholder cannot reach a loss that reads it: the loss is ``ClippedPGLossFn`` and
  the policy trains through ``Policy.train`` itself (the patched call that puts the loss on its
  on-policy path; a subclass with its own ``train`` might not call it).

How the step is skipped, per tag: v0.7.0+ wraps ``opd._skip_prev_logprobs`` (NeMo-RL's own
predicate, read through the module by ``grpo_train``), so NeMo-RL's own skip path runs
(zeros, no ``prepare_for_lp_inference`` when the reference pass is skipped too); v0.5.0 /
v0.6.0 answer ``Policy.get_logprobs`` with zeros, and v0.6.0's sequence-level error metrics
(which would be computed from those zeros) are answered with placeholders. Placeholders are
never logged as if real (:mod:`.honest_logs`).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from grpo_patches.call_args import bind
from grpo_patches.patching import overriding_class
from grpo_patches.plugins import hook

from . import FRAMEWORK, POLICY, old_logprob_rows
from .calls import setting
from .placeholders import zero_logprobs
from .state import LOOP, LoopCall


def _needed_elsewhere(loop: LoopCall) -> list[str]:
    """What besides the policy ratio reads this run's prev log-probs."""
    config, loss = loop.config, loop.loss_fn
    needs = []
    if getattr(loss, "use_importance_sampling_correction", False):
        needs.append("loss_fn.use_importance_sampling_correction (weights exp(prev - generation))")
    if setting(config, "grpo.seq_logprob_error_threshold") is not None:
        needs.append("grpo.seq_logprob_error_threshold (masks rows by prev vs generation)")
    estimator = setting(config, "grpo.adv_estimator.name", "grpo")
    if (estimator == "reinforce_plus_plus" and setting(config, "loss_fn.use_kl_in_reward", False)
            and setting(config, "loss_fn.reference_policy_kl_penalty", 0.0)):
        needs.append("the reinforce_plus_plus advantage with use_kl_in_reward")
    if setting(config, "on_policy_distillation.enabled", False):
        needs.append("on_policy_distillation (its loss reads prev log-probs)")
    return needs


def _inexact(loop: LoopCall) -> list[str]:
    """Why the loss would not reproduce the pass from the detached current log-probs, or the zero
    placeholder could reach a loss that reads it (the skip is exact only through the patched
    ``Policy.train``, which puts ``ClippedPGLossFn`` on its on-policy path for the call)."""
    loss = loop.loss_fn
    problems = [f"loss_fn.{name} changes the loss on NeMo-RL's on-policy path"
                for name in ("disable_ppo_ratio", "use_cispo") if getattr(loss, name, False)]
    if type(loss).__name__ != "ClippedPGLossFn":
        problems.append(f"the loss is {type(loss).__name__}, not ClippedPGLossFn (no known on-policy path)")
    policy_module = sys.modules.get(POLICY)
    policy_class = getattr(policy_module, "Policy", None)
    if isinstance(policy_class, type) and isinstance(loop.policy, policy_class):
        owner = overriding_class(type(loop.policy), policy_class, "train")
        if owner is not None:
            problems.append(f"{owner.__name__}.train overrides Policy.train (the call that puts the loss on its "
                            "on-policy path)")
    return problems


def train_batch_size(policy: Any, gbs: int | None = None) -> int:
    """Rows per optimizer step of a ``Policy.train`` call."""
    return int(gbs or setting(policy, "cfg.train_global_batch_size"))


#: :func:`decide`'s answer when the pass is deferred to ``Policy.train`` and cut to the rows some loss reads.
DEFERRED = "deferred"


def decide(loop: LoopCall, rows: int | None = None) -> str | None:
    """``None`` when this step's pass may be skipped, :data:`DEFERRED` when it is deferred to
    ``Policy.train`` for the rows after the first optimizer step (:mod:`.old_logprob_rows`, option
    ``recompute``), else why it runs.

    :param rows: the batch's rows when known (v0.5 / v0.6 see it), else the configured
        rollout batch ``num_prompts_per_step * num_generations_per_prompt``.
    """
    if not FRAMEWORK.on("logprob_skip"):  # verify mode's "disable" switched it off
        return "runs: logprob_skip is off (switched off by verification: see the logprob_skip note)"
    inexact = _inexact(loop)
    if inexact:
        return f"runs: {'; '.join(inexact)}"
    if rows is None:
        rows = int(setting(loop.config, "grpo.num_prompts_per_step", 0)) * int(
            setting(loop.config, "grpo.num_generations_per_prompt", 0))
    gbs = train_batch_size(loop.policy)
    steps = max(1, rows // gbs) if gbs else 1
    needed = _needed_elsewhere(loop)
    compute = hook().grpo_recompute_old_logps(framework=FRAMEWORK.name, consumptions_left=steps, window_steps_left=1,
                                              needed_elsewhere=bool(needed))
    if not compute:
        return None
    if needed:
        return f"runs: needed by {'; '.join(needed)}"
    if steps > 1:
        why = old_logprob_rows.why_not(loop)
        if why is None:
            return DEFERRED
        return (f"runs: {rows} rows per step make {steps} optimizer steps (train_global_batch_size={gbs}); "
                f"the later ones are off-policy, and the pass runs on every row: {why}")
    return "runs: a grpo_recompute_old_logps plugin decided"


def _note(reason: str | None) -> None:
    if reason == DEFERRED:
        return  # noted at train time, where the rows are known (:mod:`.old_logprob_rows`)
    text = ("skipped: provably on-policy (one optimizer step per rollout batch, nothing else reads them); "
            "the loss uses the detached current log-probs") if reason is None else reason
    FRAMEWORK.note("old_logprob_pass", text)


def grpo_train(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``grpo.grpo_train``: the synchronous loop, the only one whose steps can be on-policy; the
    call is a :class:`~.state.LoopCall` (:mod:`.state`: who reads what of it)."""
    if not FRAMEWORK.on("logprob_skip"):
        return wrapped(*args, **kwargs)
    call = bind(wrapped, args, kwargs)
    with LOOP.entered(LoopCall(policy=call["policy"], loss_fn=call["loss_fn"], config=call["master_config"])):
        return wrapped(*args, **kwargs)


def async_grpo_train(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``grpo.async_grpo_train``: generation runs ahead of training there, so a trajectory may come
    from older weights than the step that consumes it: never provably on-policy, the pass runs.
    Patched only so that ``status()`` says so instead of saying nothing."""
    if FRAMEWORK.on("logprob_skip"):
        FRAMEWORK.note("old_logprob_pass", "runs: async_grpo_train trains on trajectories that older weights may have "
                                           "generated (not provably on-policy; NeMo-RL >= 0.7.0 skips it itself only "
                                           "under loss_fn.force_on_policy_ratio)")
    return wrapped(*args, **kwargs)


def skip_prev_logprobs(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``opd._skip_prev_logprobs(master_config)`` (v0.7.0+), asked once per step by ``grpo_train``."""
    upstream = wrapped(*args, **kwargs)
    loop = LOOP.current()
    if loop is None:
        return upstream
    if upstream:
        loop.prev, loop.placeholders = "upstream", True
        FRAMEWORK.note("old_logprob_pass", "skipped by NeMo-RL itself (loss_fn.force_on_policy_ratio; nothing "
                                           "counted as saved)")
        return upstream
    reason = decide(loop)
    _note(reason)
    skip = reason is None or reason == DEFERRED
    loop.prev = ("skipped" if reason is None else "deferred") if skip else "run"
    loop.placeholders = skip
    return skip


def get_logprobs(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``Policy.get_logprobs`` (v0.5 / v0.6) inside ``grpo_train``: zeros when provably on-policy
    (the pass the adapter runs itself, late or on a subset of rows, runs with ``FRAMEWORK.unpatched()``)."""
    loop = LOOP.current()
    if loop is None or instance is not loop.policy:
        return wrapped(*args, **kwargs)
    data = bind(wrapped, args, kwargs)["data"]
    reason = decide(loop, rows=int(data["input_ids"].shape[0]))
    _note(reason)
    loop.placeholders = False
    if reason is not None and reason != DEFERRED:
        loop.prev = "run"
        return wrapped(*args, **kwargs)
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    loop.prev = "skipped" if reason is None else "deferred"
    return BatchedDataDict({"logprobs": zero_logprobs(data)})


def compute_and_apply_seq_logprob_error_masking(wrapped: Callable[..., Any], instance: Any, args: tuple,
                                                kwargs: dict) -> Any:
    """``grpo.compute_and_apply_seq_logprob_error_masking`` (v0.6.0): placeholders when prev is
    zeros (no threshold is set then, so there is nothing to mask); dropped from the logs."""
    loop = LOOP.current()
    if loop is None or loop.prev not in ("skipped", "deferred"):
        return wrapped(*args, **kwargs)
    loop.placeholders = True
    return 0.0, 0, 0.0  # (max_seq_mult_prob_error, num_masked_seqs, masked_correct_pct)
