"""What every process of an open-instruct end-to-end run on a CPU gets (tests and benchmarks only).

``python open_instruct/grpo_fast.py ...`` runs a driver and Ray actors: the learner
(``PolicyTrainerRayProcess``), the rollout engines (``vllm_utils.LLMRayActor``), the
``DataPreparationActor``, the ``ActorManager`` and Ray queues. ``main``'s ``ray.init`` hands the driver's
environment to every one of them, so the start-up folder's ``sitecustomize`` runs :func:`install` in each
when ``GRPO_PATCHES_OPEN_INSTRUCT_E2E`` holds the run's settings (JSON: ``dump`` folder, ``seed``,
``bf16``, ``optimizer``). Nothing of open-instruct is edited; each stand-in replaces what a CPU lacks:

* vLLM (the engines and its weight transfer): :mod:`.rollout_engine`'s ``CpuEngine`` takes
  ``vllm_utils.LLMRayActor``'s place, its weight-transfer stand-ins vLLM's names;
* one GPU per learner: in every process, the in-process harness's stand-ins
  (:func:`grpo_patches_testing.open_instruct_cpu.cpu_stand_ins`: ``torch.cuda.set_device`` a no-op,
  the model loaded without ``device_map`` and, unless ``bf16``, in fp32 with open-instruct's DeepSpeed
  configs made with ``bf16=False``, ``optimizer="sgd"``: ``torch.optim.AdamW`` built as SGD); in the
  learner's process (its ``RayProcess.__init__``), NCCL -> gloo and, for the actor's thread (Ray runs a
  synchronous actor's methods on its main thread), a torch function mode sending ``"cuda"``
  placements to the CPU (``self.device`` is ``torch.device(local_rank)``, i.e. ``cuda:0``);
* a GPU to compute MFU for: ``one_training_step`` logs utilization metrics from ``ModelDims.device_name``
  (set from ``torch.cuda.get_device_name``, asserted present): the device is named ``"cpu"``, with nominal
  specs in ``GPU_SPECS`` (the utilization metrics are timings; no test compares them);
* a weight sync slow enough to be seen: after starting the weight-sync thread, ``run_training`` polls
  ``ActorManager.should_stop`` until it has seen the engines paused (``True``) and resumed
  (``grpo_fast.py:1847-1862``, ``health_check_fn(expect_new_weight_sync=True)``); the stand-in's sync
  (no vLLM to pause, a tiny model) can pause and resume between two polls, and the driver then waits
  for a pause it never sees until ``WEIGHT_SYNC_TIMEOUT_S`` (measured: 120 s, then "Weight sync timed
  out", on a loaded machine). ``ActorManager.should_stop`` answers ``True`` once after each pause even
  when the pause already ended (the driver is its only reader here: the stand-in engine never asks);
* numpy's and Python's global random generators are seeded at start-up: ``DataPreparationActor``
  shuffles each step's micro-batches with ``np.random.permutation`` (unseeded upstream), and two runs
  must get the same batches;
* observation (:mod:`.run_records`): logged metrics, per-step learner records, rollouts;
* a test's planted fault (settings ``fault``: ``"module:name"`` of a context manager, e.g. one of
  ``tests/helpers/open_instruct_compare.py``), entered for good in the learner's process.
"""

from __future__ import annotations

import functools
import json
import os
import random
from typing import Any

SETTINGS_ENV = "GRPO_PATCHES_OPEN_INSTRUCT_E2E"
#: Nominal specs of the "cpu" device for open-instruct's utilization metrics (never compared).
CPU_SPECS = {"flops": 1e12, "memory_size": 24e9, "memory_bandwidth": 50e9}
#: The planted faults entered in this process (settings ``fault``), for good.
FAULTS: list[Any] = []


@functools.lru_cache(maxsize=1)
def settings() -> dict[str, Any]:
    return {"seed": 1, "bf16": False, "optimizer": "sgd", **json.loads(os.environ.get(SETTINGS_ENV) or "{}")}


def pickle_module_subclasses_by_reference() -> None:
    """Ray's cloudpickle pickles a module *subclass* by value and fails on torch 2.13's
    ``torch.distributed.config`` (a ``ConfigModuleInstance``), which it takes along when it ships
    ``PolicyTrainerRayProcess`` by value: such modules are pickled by reference, as plain ones are
    (in every process that ships the class: the driver too). Idempotent."""
    import types

    from ray.cloudpickle import cloudpickle as cp

    override = cp.Pickler.reducer_override
    if getattr(override, "module_subclasses_by_reference", False):
        return

    def reducer_override(self: Any, obj: Any) -> Any:
        if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType:
            return cp._module_reduce(obj)
        return override(self, obj)

    reducer_override.module_subclasses_by_reference = True  # type: ignore[attr-defined]
    cp.Pickler.reducer_override = reducer_override


def install() -> None:
    """Register the stand-ins and records (each applied when open-instruct imports its module)."""
    import wrapt

    from grpo_patches_testing.open_instruct_startup import rollout_engine, run_records

    seed = settings()["seed"]
    random.seed(seed)
    wrapt.register_post_import_hook(lambda np: np.random.seed(seed), "numpy")
    rollout_engine.install_vllm_names()
    wrapt.register_post_import_hook(_engines, "open_instruct.vllm_utils")
    wrapt.register_post_import_hook(_utils_stand_ins, "open_instruct.utils")
    wrapt.register_post_import_hook(_pauses_seen, "open_instruct.actor_manager")
    wrapt.register_post_import_hook(run_records.observe_logged_metrics, "open_instruct.model_utils")


def _engines(vllm_utils: Any) -> None:
    from grpo_patches_testing.open_instruct_startup.rollout_engine import CpuEngine

    vllm_utils.LLMRayActor = CpuEngine  # create_vllm_engines builds ray.remote(LLMRayActor)


def _pauses_seen(actor_manager: Any) -> None:
    cls = actor_manager.ActorManager
    set_should_stop, should_stop = cls.set_should_stop, cls.should_stop

    @functools.wraps(set_should_stop)
    def set_pause(self: Any, value: bool) -> Any:
        if value:
            self._e2e_unseen_pause = True
        return set_should_stop(self, value)

    @functools.wraps(should_stop)
    def pause_seen(self: Any) -> bool:
        if getattr(self, "_e2e_unseen_pause", False):
            self._e2e_unseen_pause = False
            return True
        return should_stop(self)

    cls.set_should_stop, cls.should_stop = set_pause, pause_seen


def harness_config() -> Any:
    from grpo_patches_testing.open_instruct_cpu import Config

    s = settings()
    return Config(bf16=bool(s["bf16"]), optimizer=s["optimizer"], stage3_param_persistence_threshold=None)


def _utils_stand_ins(utils: Any) -> None:
    """At ``open_instruct.utils``' import, before Ray unpickles the learner class (its globals then take
    ``get_train_ds_config`` and ``get_eval_ds_config`` from this module by name)."""
    from grpo_patches_testing.open_instruct_cpu import cpu_stand_ins

    for owner, name, value in cpu_stand_ins(harness_config(), utils):
        setattr(owner, name, value)
    utils.GPU_SPECS.setdefault("cpu", CPU_SPECS)
    post_init = utils.ModelDims.__post_init__

    @functools.wraps(post_init)
    def __post_init__(self: Any) -> None:  # noqa: N807
        post_init(self)
        if self.device_name is None:
            self.device_name = "cpu"

    utils.ModelDims.__post_init__ = __post_init__
    init = utils.RayProcess.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        if type(self).__name__ == "PolicyTrainerRayProcess":
            _learner_process()
        init(self, *args, **kwargs)

    utils.RayProcess.__init__ = __init__


def _learner_process() -> None:
    """This process hosts a learner: NCCL -> gloo, CUDA placements -> CPU for the actor's thread, records."""
    import deepspeed
    import torch.distributed as dist
    from open_instruct import data_types, utils

    from grpo_patches_testing import cpu_torch
    from grpo_patches_testing.open_instruct_startup import run_records

    if run_records.LEARNER is not None:  # once per process
        return
    real_init = dist.init_process_group

    @functools.wraps(real_init)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if args:
            args = ("gloo", *args[1:])
        else:
            kwargs["backend"] = "gloo"
        return real_init(*args, **kwargs)

    dist.init_process_group = init_process_group
    cpu_torch.cuda_to_cpu_mode().__enter__()  # for good: the actor's methods all run on this thread
    run_records.observe_learner(deepspeed, data_types, utils)
    fault = settings().get("fault")
    if fault:  # grpo_patches looks its wrappers up at each call: the fault is seen from the first step
        import importlib

        module, _, name = fault.partition(":")
        FAULTS.append(planted := getattr(importlib.import_module(module), name)())
        planted.__enter__()  # kept referenced: a collected generator context would run its finally: (undo)
