"""DeepSpeed's CPU comm op for open-instruct's learner on a CPU: where it is built, the environment
every process of a run needs before DeepSpeed is imported, and the one-off build.

``python -m grpo_patches_testing.open_instruct_deepspeed_op`` builds it (the open-instruct cells'
``after_install`` in compat/matrix.toml; compat/README.md).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: The DeepSpeed op open-instruct's set-up builds on first use (a killed build leaves a lock file
#: behind and hangs every later run): built once into the venv, see compat/README.md.
EXTENSIONS = "torch_extensions"


def extensions_dir() -> str:
    """``TORCH_EXTENSIONS_DIR``, else ``torch_extensions/`` in the venv holding deepspeed (a ready
    venv a cell is layered on keeps its op there)."""
    import importlib.util

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    spec = importlib.util.find_spec("deepspeed")
    # deepspeed/__init__.py lies in <venv>/lib/pythonX.Y/site-packages/deepspeed/
    venv = Path(spec.origin).parents[4] if spec and spec.origin else Path(sys.prefix)
    return str(venv / EXTENSIONS)


def environment() -> dict[str, str]:
    """What every process of a run needs before DeepSpeed is imported."""
    return {"DS_ACCELERATOR": "cpu", "TORCH_EXTENSIONS_DIR": extensions_dir(),
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}


def build_ops() -> Path:
    """Build DeepSpeed's CPU shared-memory comm op (``deepspeed_shm_comm``) into :func:`extensions_dir`
    once: ``deepspeed.init_distributed`` JIT-builds it on first use (minutes on 2 cores), and a build
    that is killed leaves ``lock`` behind, on which every later run waits forever. A lock without a
    built op is such a leftover (run this only while no other build runs): it is removed first."""
    os.environ.update(environment())
    op = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "deepspeed_shm_comm"
    stale = op / "lock"
    if stale.exists() and not (op / "deepspeed_shm_comm.so").exists():
        stale.unlink()
    from deepspeed.accelerator import get_accelerator

    get_accelerator().create_op_builder("ShareMemCommBuilder").load()
    return op


if __name__ == "__main__":  # the cells' after_install
    print(f"DeepSpeed CPU comm op: {build_ops()}")
