"""What differs between NeMo-RL tags, for code that drives NeMo-RL's real objects (and its stand-in):
the ``master_config`` shape, the loss module and ``ClippedPGLossFn``'s config, the DTensor worker class."""

from __future__ import annotations

import importlib
from typing import Any


class Section(dict):
    """A config section read both ways, like v0.7.0+'s pydantic models (``cfg.key``) and dicts."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


def master_config(tag: str, *, loss: dict | None = None, grpo: dict | None = None, policy: dict | None = None) -> Any:
    """``master_config`` as each tag holds it (the sections the adapter reads, small defaults that
    ``loss`` / ``grpo`` / ``policy`` override): dicts on v0.5 / v0.6, attribute objects from v0.7."""
    loss_cfg = {"reference_policy_kl_penalty": 0.0, "ratio_clip_min": 0.2, "ratio_clip_max": 0.28,
                "ratio_clip_c": None, "token_level_loss": True, **(loss or {})}
    grpo_cfg = {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "seq_logprob_error_threshold": None,
                **(grpo or {})}
    policy_cfg = {"train_global_batch_size": 8, "train_micro_batch_size": 2, "logprob_batch_size": 4,
                  "dynamic_batching": {"enabled": False}, **(policy or {})}
    if tag in ("v0.5.0", "v0.6.0"):
        return {"loss_fn": loss_cfg, "grpo": grpo_cfg, "policy": policy_cfg}
    # pydantic models from v0.7.0: every field has a default
    loss_cfg = {"force_on_policy_ratio": False, "use_importance_sampling_correction": False, "disable_ppo_ratio": False,
                "use_kl_in_reward": False, "use_cispo": False, "positive_example_nll_weight": 0.0, **loss_cfg}
    grpo_cfg = {"skip_reference_policy_logprobs_calculation": False, **grpo_cfg}
    return Section(loss_fn=Section(loss_cfg), grpo=Section(grpo_cfg) if tag == "main" else dict(grpo_cfg),
                   policy=policy_cfg)


def loss_module(tag: str) -> Any:
    """The module holding ``ClippedPGLossFn`` on ``tag`` (it moved after v0.5.0)."""
    return importlib.import_module("nemo_rl.algorithms.loss_functions" if tag == "v0.5.0"
                                   else "nemo_rl.algorithms.loss.loss_functions")


def loss_config(tag: str, **overrides: Any) -> Any:
    """The config ``ClippedPGLossFn`` takes on ``tag`` (a dict on v0.5 / v0.6, the pydantic model after)."""
    cfg = dict(reference_policy_kl_penalty=0.0, reference_policy_kl_type="k3", kl_input_clamp_value=20.0,
               kl_output_clamp_value=10.0, ratio_clip_min=0.2, ratio_clip_max=0.28, ratio_clip_c=None,
               use_on_policy_kl_approximation=False, use_importance_sampling_correction=False,
               truncated_importance_sampling_ratio=None, token_level_loss=True)
    cfg.update(overrides)
    if tag in ("v0.5.0", "v0.6.0"):
        return cfg
    config_class = getattr(loss_module(tag), "ClippedPGLossConfig", None)
    return config_class(**cfg) if config_class is not None else Section(cfg)


def make_loss(tag: str, **overrides: Any) -> Any:
    """``ClippedPGLossFn`` of ``tag`` with :func:`loss_config` (``overrides`` as its keys)."""
    return loss_module(tag).ClippedPGLossFn(loss_config(tag, **overrides))


def worker_class(tag: str) -> type:
    """The class whose methods the DTensor policy worker runs (the Ray actor wraps it)."""
    module = importlib.import_module("nemo_rl.models.policy.workers.dtensor_policy_worker_v2")
    if tag == "v0.5.0":  # the @ray.remote class itself holds train()
        return module.DTensorPolicyWorkerV2.__ray_metadata__.modified_class.__ray_actor_class__
    return module.DTensorPolicyWorkerV2Impl
