"""The reference-policy pass and model (driver side).

NeMo-RL >= 0.7.0 builds no reference model and skips the reference pass by itself when
``loss_fn.reference_policy_kl_penalty == 0`` (``grpo.setup``: ``init_reference_model =
reference_policy_kl_penalty > 0``); this adapter only reports it. v0.5.0 and v0.6.0 build the
reference model always (``Policy(..., init_reference_model=True)`` by default: a pinned CPU copy
of the weights on every worker) and run the pass every step (v0.6.0 unless
``grpo.skip_reference_policy_logprobs_calculation``): here, when the
``grpo_skip_reference_pass`` hook says so, the policy is built without it
(:func:`init`, inside ``grpo.setup`` only: :class:`~.state.SetupCall`) and its reference log-probs
are answered with zeros without calling the workers (:func:`get_reference_policy_logprobs`). Zeros are
what v0.7.0 itself puts there; with a KL penalty of 0 the loss never reads them.
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches.call_args import bind
from grpo_patches.plugins import hook

from . import FRAMEWORK
from .calls import setting
from .placeholders import zero_logprobs
from .state import SETUP, peek_policy, policy_state

KL_SETTING = "loss_fn.reference_policy_kl_penalty"


def decide(config: Any) -> Any:
    """The ``grpo_skip_reference_pass`` hook's answer for ``master_config``."""
    kl = setting(config, KL_SETTING, 0.0)
    return hook().grpo_skip_reference_pass(framework=FRAMEWORK.name, kl_coefficients={KL_SETTING: kl},
                                           kl_metrics_requested=False)


def note_upstream(decision: Any) -> None:
    """v0.7.0+: NeMo-RL decides itself; say what it does (nothing is counted as saved)."""
    if decision is None:
        return
    if decision.skip:
        FRAMEWORK.note("reference_pass", f"skipped by NeMo-RL itself (>= 0.7.0: no reference model at KL 0; "
                                         f"nothing counted as saved): {decision.reason}")
    else:
        FRAMEWORK.note("reference_pass", f"runs: {decision.reason}")


def init(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``Policy.__init__`` (v0.5 / v0.6): no reference model when ``grpo.setup`` decided so."""
    setup = SETUP.current()
    decision = setup.reference if setup is not None else None
    if decision is None or not decision.skip:
        return wrapped(*args, **kwargs)
    call = bind(wrapped, args, kwargs)
    if not call.get("init_reference_model", True):
        return wrapped(*args, **kwargs)  # the caller already asked for none: nothing saved
    result = call.call(wrapped, init_reference_model=False)
    policy_state(instance).reference_skipped = True
    FRAMEWORK.report_savings(reference_models_not_built=1)
    FRAMEWORK.note("reference_pass", f"skipped (reference model not built, pass answered with zeros): "
                                     f"{decision.reason}")
    return result


def get_reference_policy_logprobs(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``Policy.get_reference_policy_logprobs`` (v0.5 / v0.6): zeros for a policy built without
    a reference model (KL penalty 0: the loss never reads them), without calling the workers."""
    own = peek_policy(instance)
    if own is None or not own.reference_skipped:
        return wrapped(*args, **kwargs)
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    data = bind(wrapped, args, kwargs)["data"]
    FRAMEWORK.report_savings(reference_passes_skipped=1)
    return BatchedDataDict({"reference_logprobs": zero_logprobs(data)})
