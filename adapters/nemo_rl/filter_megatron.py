"""The zero-advantage filter with NeMo-RL's Megatron policy worker: where it runs, and why not elsewhere.

With ``policy.megatron_cfg.enabled`` NeMo-RL trains in ``MegatronPolicyWorker(Impl)``. On v0.6.0,
v0.7.0 and main the filter runs there (:mod:`.filter_megatron_worker`, proven on the real worker). On the other
tags the worker is not patched: ``grpo.setup`` (driver, wrapped) sees the config before any worker
exists and says so — ``"auto"``: a note in ``status()``, ``True``: one clear error before training
(:data:`NOT_PATCHED` gives the reason per tag line). Nothing is imported from the Megatron worker
here (it needs Megatron-Bridge).

:func:`problems` lists the Megatron settings the worker-side filter does not cover yet; the
worker switches the filter off there (``"auto"``) or raises (``True``).
"""

from __future__ import annotations

from typing import Any, Callable

from grpo_patches import api
from grpo_patches.refuse_or_note import refuse_or_note

from .calls import arguments
from .settings import setting
from .state import FRAMEWORK
from .version import read_version

#: Why the Megatron worker of a tag line (major.minor) is not patched.
NOT_PATCHED = {
    "0.5": "NeMo-RL v0.5.0's Megatron worker is not patched (not run here)",
}


def _why() -> str:
    found = read_version() or ""
    line = ".".join(found.split(".")[:2])
    reason = NOT_PATCHED.get(line, f"NeMo-RL {found}'s Megatron worker is not patched")
    return f"{reason}; the zero-advantage filter runs in NeMo-RL v0.6.0+'s Megatron worker and the DTensor worker"


def setup_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``grpo.setup(master_config, ...)`` on a tag whose Megatron worker is not patched: a note
    (``"auto"``) or an error (``True``) for a Megatron policy."""
    options = api.active_options(FRAMEWORK)
    config = arguments(wrapped, args, kwargs)["master_config"]
    if options is not None and options.zero_advantage_filter is not False \
            and setting(config, "policy.megatron_cfg.enabled", False):
        refuse_or_note(FRAMEWORK, "zero_advantage_filter", _why())
    return wrapped(*args, **kwargs)


def verify_setup_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``grpo.setup(master_config, ...)`` with ``verify_every``: verify mode does not cover the Megatron
    worker, so a Megatron policy gets an error before training (a note under ``enable("all")``)."""
    config = arguments(wrapped, args, kwargs)["master_config"]
    if setting(config, "policy.megatron_cfg.enabled", False):
        refuse_or_note(FRAMEWORK, "verify_every", "verify mode does not cover NeMo-RL's Megatron policy worker yet: "
                       "no check would run on its updates; use the DTensor worker")
    return wrapped(*args, **kwargs)


def problems(cfg: Any, model_config: Any, dropped_rows_metrics: bool) -> list[str]:
    """The worker's settings (``policy`` config, megatron-core model config) the filter does not cover yet."""
    found = []
    if int(setting(cfg, "megatron_cfg.virtual_pipeline_model_parallel_size", 1) or 1) > 1:
        found.append("virtual pipeline stages (policy.megatron_cfg.virtual_pipeline_model_parallel_size > 1: the "
                     "interleaved schedule) are not covered by the zero-advantage filter with the Megatron worker "
                     "yet (pipeline parallelism without them is); unset it")
    if int(setting(cfg, "megatron_cfg.context_parallel_size", 1) or 1) > 1:
        found.append("context parallelism (policy.megatron_cfg.context_parallel_size > 1) is not covered by the "
                     "zero-advantage filter with the Megatron worker yet; set it to 1")
    if setting(cfg, "dynamic_batching.enabled", False):
        found.append("dynamic batching with the Megatron worker is not covered by the zero-advantage filter yet; "
                     "set policy.dynamic_batching.enabled=false")
    if dropped_rows_metrics:
        found.append("dropped_rows_metrics=True is not supported with NeMo-RL's Megatron worker yet; "
                     "pass dropped_rows_metrics=False")
    if int(getattr(model_config, "mtp_num_layers", None) or 0) > 0:
        found.append("multi-token prediction (mtp_num_layers > 0) trains every row's tokens, so zero-advantage rows "
                     "have a gradient; turn it off or pass zero_advantage_filter=False")
    if setting(cfg, "draft.enabled", False):
        found.append("the draft model (policy.draft.enabled) trains on every row; turn it off or pass "
                     "zero_advantage_filter=False")
    return found
