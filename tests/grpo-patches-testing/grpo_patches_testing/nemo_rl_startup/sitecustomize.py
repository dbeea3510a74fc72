# Start-up hook of the NeMo-RL end-to-end runs (grpo_patches_testing.nemo_rl_run_grpo: the e2e cells, the benchmark).
#
# The cell puts this folder on PYTHONPATH so that every process of the run -- the driver
# (examples/run_grpo.py) and the Ray workers NeMo-RL starts in their own venv -- runs it. It acts
# only when GRPO_PATCHES_E2E_CPU is set, and then imports nemo_e2e_cpu (next to this file): a CPU
# stand-in for what a CPU-only machine lacks (CUDA, NCCL, vLLM). It is never imported as part of
# grpo_patches and nothing a user runs; grpo_patches' own start-up directory, when present (`grpo-patches run`),
# comes first on PYTHONPATH and chains to this file.
import os as _os

if _os.environ.get("GRPO_PATCHES_E2E_CPU"):
    try:
        import nemo_e2e_cpu  # noqa: F401

        nemo_e2e_cpu.install()
    except BaseException as _exc:  # never break an interpreter's start-up; the cell sees the message
        import sys as _sys

        print("nemo_e2e_cpu: start-up hook failed:", repr(_exc), file=_sys.stderr)
