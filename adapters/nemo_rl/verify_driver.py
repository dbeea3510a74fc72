"""Verify mode on the driver: the skipped prev-logprob pass, and the workers' verdicts (v0.6.0+).

:func:`setup` (``grpo.setup``): verify mode does not cover NeMo-RL's Megatron policy worker, so a
Megatron policy gets an error before training (a note under ``enable("all")``).

The rest is called by ``Policy.train``'s wrapper (:mod:`.policy_train`) for the training calls of the policy
``grpo_train`` drives; the step is the loop's training call (0-based, from the start of the
``grpo_train`` call: one optimizer step per call whenever the pass is skipped, so it is the
workers' optimizer step too).

* :func:`run_skipped_pass`: on a verify step whose prev-logprob pass was skipped, the pass runs
  after all (NeMo-RL's ``Policy.get_logprobs``, unpatched, on the weights that generated the batch,
  as the skipped pass would have) and goes into ``data["prev_logprobs"]`` for that call only; the loss
  object carries :data:`~.state.VERIFY_PREV` (the loss's own ``force_on_policy_ratio``, for the
  workers' unpatched computation). The patched loss does not read it (it is on the on-policy
  path); the workers compare it with the log-probs the loss used and run NeMo-RL's unpatched
  computation on it (:mod:`.verify`). Afterwards the zeros are put back: the driver's batch is
  as without verification.
* :func:`flag_reference`: on a verify step of a policy built without its reference model
  (v0.6.0 at KL 0), the workers also compare the loss with and without the reference pass's
  zero placeholder (:data:`~.state.VERIFY_REFERENCE`).
* :func:`collect`: the workers' figures (``grpo_patches/verify/<quantity>``, each worker's
  largest) are reduced to their maximum in the metrics NeMo-RL logs and recorded for this
  process's ``status()``; a ``grpo_patches/verify/switched_off/<option>`` marker (a worker's
  ``"disable"`` verdict: that step already used the unpatched result) switches the option off
  here too. That is how a switch-off in the workers (separate Ray processes) reaches the
  driver-side skip: ``logprob_skip`` off, the prev-logprob pass runs from the next step on
  (:func:`.old_logprobs.decide` reads the options every step). The workers switched the filter
  and the tiled loss off themselves (each worker that verified: all of them, in agreement).
* :func:`raised`: a worker's :class:`~grpo_patches.errors.ExactnessError` reaches the driver
  wrapped by Ray; it is raised again as itself.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from grpo_patches import verify, verify_log
from grpo_patches.call_args import bind
from grpo_patches.errors import ExactnessError, GrpoPatchesWarning

from . import FRAMEWORK, PACKAGE, version
from .calls import setting
from .state import VERIFY_PREV, VERIFY_REFERENCE, peek_policy
from .verify_results import SWITCHED_OFF


def setup(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``grpo.setup(master_config, ...)`` with ``verify_every``: a Megatron policy is refused (module docstring)."""
    config = bind(wrapped, args, kwargs)["master_config"]
    if setting(config, "policy.megatron_cfg.enabled", False):
        FRAMEWORK.refuse_or_note("verify_every", "verify mode does not cover NeMo-RL's Megatron policy worker yet: "
                                 "no check would run on its updates; use the DTensor worker")
    return wrapped(*args, **kwargs)


def due(step: int) -> bool:
    """Whether training call ``step`` of the loop is verified (v0.6.0+: v0.5.0 has no verify mode)."""
    return version.at_least(PACKAGE, "0.6.0") and FRAMEWORK.verify_due(step)


def run_skipped_pass(policy: Any, data: Any, loss_fn: Any, force: Any) -> Callable[[], None]:
    """Run the skipped prev-logprob pass for the workers to compare (module docstring).

    :param force: the loss's own ``force_on_policy_ratio`` (``None``: it had none).
    :returns: what puts the batch and the loss back after the call."""
    zeros = data["prev_logprobs"]
    with FRAMEWORK.unpatched():  # NeMo-RL's own pass (Policy.get_logprobs's record would skip it again)
        real = policy.get_logprobs(data)["logprobs"]
    data["prev_logprobs"] = real.to(zeros.dtype) if hasattr(real, "to") else real
    setattr(loss_fn, VERIFY_PREV, {"force_on_policy_ratio": force})

    def restore() -> None:
        data["prev_logprobs"] = zeros
        loss_fn.__dict__.pop(VERIFY_PREV, None)

    return restore


def flag_reference(policy: Any, loss_fn: Any) -> Callable[[], None] | None:
    """On a verify step of a policy built without its reference model (v0.6.0, KL 0): the loss
    carries :data:`~.state.VERIFY_REFERENCE` for the call, the workers compare the loss with and
    without the zero placeholder. ``None`` when the reference pass was not skipped by grpo_patches."""
    own = peek_policy(policy)
    if own is None or not own.reference_skipped:
        return None
    setattr(loss_fn, VERIFY_REFERENCE, True)
    return lambda: loss_fn.__dict__.pop(VERIFY_REFERENCE, None)


def collect(metrics: dict[str, list], step: int) -> None:
    """The workers' figures and switch-offs of training call ``step`` (module docstring)."""
    figures: dict[str, float] = {}
    switched = []
    for key in list(metrics):
        if key.startswith(SWITCHED_OFF):
            switched.append(key[len(SWITCHED_OFF):])
            metrics.pop(key)
        elif key.startswith(verify.METRIC_PREFIX):
            values = [float(v) for v in metrics[key]]
            figures[key] = max(values) if values else 0.0
            metrics[key] = [figures[key]]
            verify_log.record(FRAMEWORK.name, step, key[len(verify.METRIC_PREFIX):], figures[key], None)
    if not switched:
        return
    shown = ", ".join(f"{k[len(verify.METRIC_PREFIX):]} = {v:.3e}" for k, v in figures.items())
    reason = f"switched off by verification in the policy workers at step {step} ({shown})"
    for option in switched:
        FRAMEWORK.switch_off(option, reason)
    warnings.warn(f"grpo_patches verify: {FRAMEWORK.name}: {', '.join(switched)} {reason}; that step used the unpatched "
                  "result and the run goes on without them", GrpoPatchesWarning, stacklevel=3)


def raised(exc: BaseException) -> ExactnessError | None:
    """The :class:`ExactnessError` a worker raised, out of Ray's wrapping (``None``: not one)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ExactnessError):
        return cause
    return exc if isinstance(exc, ExactnessError) else None
