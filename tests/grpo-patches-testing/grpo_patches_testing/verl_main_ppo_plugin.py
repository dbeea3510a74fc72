"""What an end-to-end verl run on CPU needs in every process it starts (``grpo_patches_testing``).

``VERL_USE_EXTERNAL_MODULES=grpo_patches_testing.verl_main_ppo_plugin`` makes ``import verl`` import this module in
the driver and in every Ray process (verl's own extension point; no verl file is edited). Each
shim exists because verl 0.9 has no CPU path for it:

* the CPU platform (:mod:`verl_cpu_shim`): verl ships cuda / npu / rocm platforms only. Its Ray
  resource is ``"GPU"`` because verl's resource pools count GPU/NPU resources only: the test's
  Ray cluster offers logical GPUs;
* ``"cpu:gloo,cpu:gloo"``: verl asks for ``f"cpu:gloo,{device}:{backend}"``, which names the
  CPU twice on a CPU platform and torch refuses: collapsed to ``"gloo"``;
* unpinned offload: verl builds the reference model's FSDP2 ``CPUOffloadPolicy(pin_memory=True)``
  and pinning needs an accelerator: the policy is built with ``pin_memory=False``;
* the stand-in rollout (:mod:`verl_main_ppo_rollout`), registered by name in verl's two rollout
  registries when verl imports them;
* ``GRPO_E2E_OUT``: after each actor update the worker writes ``grpo_patches.status()``, its peak
  RSS, the token positions its actor forwards with gradients took (``policy_tokens``), how many
  such forwards ran (``policy_calls``) and its
  weights there, so the test reads what ran in the process that trained (not the
  driver's view).
"""

from __future__ import annotations

import json
import os

import wrapt

ROLLOUT = "grpo_patches_testing.verl_main_ppo_rollout"
NAME = "grpo_e2e_stand_in"  # = verl_main_ppo_rollout.NAME (not imported: that module imports verl)
OUT_ENV = "GRPO_E2E_OUT"


def _platform() -> None:
    from grpo_patches_testing import verl_cpu_shim

    verl_cpu_shim.install(ray_resource="GPU")


def _gloo() -> None:
    import torch.distributed as dist

    original = dist.init_process_group
    if getattr(original, "grpo_e2e", False):
        return

    def init_process_group(backend=None, *args, **kwargs):
        if isinstance(backend, str) and backend.replace(" ", "") == "cpu:gloo,cpu:gloo":
            backend = "gloo"
        return original(backend, *args, **kwargs)

    init_process_group.grpo_e2e = True
    dist.init_process_group = init_process_group


def _unpinned(module) -> None:
    base = module.CPUOffloadPolicy
    if base is None or getattr(base, "grpo_e2e", False):
        return

    class UnpinnedCPUOffloadPolicy(base):
        grpo_e2e = True

        def __init__(self, pin_memory: bool = True):
            super().__init__(pin_memory=False)

    module.CPUOffloadPolicy = UnpinnedCPUOffloadPolicy


def _register_rollout(module) -> None:
    module._ROLLOUT_REGISTRY[(NAME, "async")] = f"{ROLLOUT}.StandInRollout"


def _register_replica(module) -> None:
    def load():
        import importlib

        return importlib.import_module(ROLLOUT).StandInReplica

    module.RolloutReplicaRegistry.register(NAME, load)


#: Token positions (``input_ids.numel()``) through the actor's forwards with gradients in this process, and those forwards.
_POLICY_TOKENS = [0]
_POLICY_CALLS = [0]


def _count_policy_tokens(module, args, kwargs) -> None:
    import torch

    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is not None and torch.is_grad_enabled():
        _POLICY_TOKENS[0] += int(ids.numel())
        _POLICY_CALLS[0] += 1


def _dump_after_update(wrapped, instance, args, kwargs):
    """``TrainingWorker.train_mini_batch``: after the actor's update, this process's status and weights."""
    module = getattr(getattr(instance, "engine", None), "module", None)
    if module is not None and not getattr(module, "_grpo_e2e_counted", False):
        module.register_forward_pre_hook(_count_policy_tokens, with_kwargs=True)  # beneath every patch
        module._grpo_e2e_counted = True
    output = wrapped(*args, **kwargs)
    out = os.environ.get(OUT_ENV)
    if out and getattr(instance, "loss_fn", None) is not None:
        import torch

        import grpo_patches

        import resource

        os.makedirs(out, exist_ok=True)
        report = {"status": grpo_patches.status().get("verl", {}),
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "policy_tokens": _POLICY_TOKENS[0], "policy_calls": _POLICY_CALLS[0]}
        with open(os.path.join(out, f"worker-{os.getpid()}.json"), "w") as f:
            json.dump(report, f, default=str)
        state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
                 for k, v in instance.engine.module.state_dict().items()}
        torch.save(state, os.path.join(out, f"weights-{os.getpid()}.pt"))
    return output


def _instrument(module) -> None:
    wrapt.wrap_function_wrapper(module, "TrainingWorker.train_mini_batch", _dump_after_update)


_platform()
_gloo()
wrapt.register_post_import_hook(_unpinned, "verl.workers.engine.fsdp.transformer_impl")
wrapt.register_post_import_hook(_register_rollout, "verl.workers.rollout.base")
wrapt.register_post_import_hook(_register_replica, "verl.workers.rollout.replica")
if os.environ.get(OUT_ENV):
    wrapt.register_post_import_hook(_instrument, "verl.workers.engine_workers")

