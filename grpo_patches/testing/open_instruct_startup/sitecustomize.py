# Start-up hook of open-instruct's end-to-end runs on a CPU (tests and benchmarks only).
#
# A run puts this folder on PYTHONPATH (grpo_fast.py's ray.init hands its environment to every Ray
# worker), so every process imports it. It acts only when GRPO_PATCHES_OPEN_INSTRUCT_CPU is set, and then
# installs the test-only vLLM import stand-in (grpo_patches.testing.open_instruct_vllm): open-instruct
# imports vllm at module level everywhere, and vLLM cannot live beside torch 2.13 here. Never imported as
# part of grpo_patches; never a user's.
import os as _os

if _os.environ.get("GRPO_PATCHES_OPEN_INSTRUCT_CPU"):
    try:
        from grpo_patches.testing import open_instruct_vllm as _vllm

        _vllm.install()
    except BaseException as _exc:  # never break an interpreter's start-up; the run sees the message
        import sys as _sys

        print("open_instruct_startup: start-up hook failed:", repr(_exc), file=_sys.stderr)
