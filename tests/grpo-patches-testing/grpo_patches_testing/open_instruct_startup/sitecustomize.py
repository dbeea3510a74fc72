# Start-up hook of open-instruct's end-to-end runs on a CPU (tests and benchmarks only).
#
# A run puts this folder on PYTHONPATH (grpo_fast.py's ray.init hands its environment to every Ray
# worker), so every process imports it. It acts only when GRPO_PATCHES_OPEN_INSTRUCT_CPU is set:
# - the test-only vLLM import stand-in (grpo_patches_testing.open_instruct_vllm): open-instruct imports
#   vllm at module level everywhere, and vLLM cannot live beside torch 2.13 here;
# - Ray's cloudpickle pickles a module *subclass* by value and fails: `python open_instruct/grpo_fast.py`
#   runs as __main__, so Ray ships PolicyTrainerRayProcess by value, and cloudpickle takes along the
#   submodules its methods' names match, among them torch 2.13's torch.distributed.config (a
#   ConfigModuleInstance: "cannot pickle 'ConfigModuleInstance' object"). Modules of such a subclass
#   are pickled by reference here, as cloudpickle pickles plain modules;
# - with GRPO_PATCHES_OPEN_INSTRUCT_E2E (the run's settings, JSON) as well: the end-to-end run's CPU
#   stand-ins and records (cpu_run.py: the vLLM engines, the learner on a CPU, seeded generators).
# Never imported as part of grpo_patches; never a user's.
import os as _os

if _os.environ.get("GRPO_PATCHES_OPEN_INSTRUCT_CPU"):
    try:
        from grpo_patches_testing import open_instruct_vllm as _vllm
        from grpo_patches_testing.open_instruct_startup import cpu_run as _cpu_run

        _vllm.install()
        _cpu_run.pickle_module_subclasses_by_reference()
        if _os.environ.get("GRPO_PATCHES_OPEN_INSTRUCT_E2E"):
            _cpu_run.install()
    except BaseException as _exc:  # never break an interpreter's start-up; the run sees the message
        import sys as _sys

        print("open_instruct_startup: start-up hook failed:", repr(_exc), file=_sys.stderr)
