"""Verify mode on the driver: the skipped prev-logprob pass, and the workers' verdicts (v0.6.0+).

Called by ``Policy.train``'s wrapper (:mod:`.train_call`) for the training calls of the policy
``grpo_train`` drives; the step is the loop's training call (0-based, from the start of the
``grpo_train`` call: one optimizer step per call whenever the pass is skipped, so it is the
workers' optimizer step too).

* :func:`run_skipped_pass`: on a verify step whose prev-logprob pass was skipped, the pass runs
  after all (NeMo-RL's ``Policy.get_logprobs``, on the weights that generated the batch, as the
  skipped pass would have) and goes into ``data["prev_logprobs"]`` for that call only; the loss
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

from grpo_patches import api, verify, verify_log
from grpo_patches.errors import ExactnessError, GrpoPatchesWarning

from . import version
from .state import FRAMEWORK, VERIFY_PREV, VERIFY_REFERENCE, LoopState, peek_policy
from .verify import SWITCHED_OFF


def due(step: int) -> bool:
    """Whether training call ``step`` of the loop is verified (v0.6.0+: v0.5.0 has no verify mode)."""
    return version.at_least("0.6.0") and verify.due(FRAMEWORK, step)


def run_skipped_pass(loop: LoopState, policy: Any, data: Any, loss_fn: Any, force: Any) -> Callable[[], None]:
    """Run the skipped prev-logprob pass for the workers to compare (module docstring).

    :param force: the loss's own ``force_on_policy_ratio`` (``None``: it had none).
    :returns: what puts the batch and the loss back after the call."""
    zeros = data["prev_logprobs"]
    loop.bypass = True
    try:
        real = policy.get_logprobs(data)["logprobs"]
    finally:
        loop.bypass = False
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
            verify_log.record(FRAMEWORK, step, key[len(verify.METRIC_PREFIX):], figures[key], None)
    if not switched:
        return
    shown = ", ".join(f"{k[len(verify.METRIC_PREFIX):]} = {v:.3e}" for k, v in figures.items())
    reason = f"switched off by verification in the policy workers at step {step} ({shown})"
    for option in switched:
        api.switch_off(FRAMEWORK, option, reason)
    warnings.warn(f"grpo_patches verify: {FRAMEWORK}: {', '.join(switched)} {reason}; that step used the unpatched "
                  "result and the run goes on without them", GrpoPatchesWarning, stacklevel=3)


def raised(exc: BaseException) -> ExactnessError | None:
    """The :class:`ExactnessError` a worker raised, out of Ray's wrapping (``None``: not one)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, ExactnessError):
        return cause
    return exc if isinstance(exc, ExactnessError) else None
