"""What open-instruct's cells stand on, testable without open-instruct: its uv.lock turned into pip
constraints (compat/uv_lock.py) and the test-only vLLM import stand-in."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from grpo_patches_testing import open_instruct_vllm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat"))
import uv_lock  # noqa: E402

LOCK = '''
version = 1
[[package]]
name = "deepspeed"
version = "0.18.4"
source = { registry = "https://pypi.org/simple" }

[[package]]
name = "protobuf"
version = "6.33.4"
source = { registry = "https://pypi.org/simple" }
resolution-markers = ["sys_platform == 'darwin'"]

[[package]]
name = "protobuf"
version = "6.33.5"
source = { registry = "https://pypi.org/simple" }
resolution-markers = ["platform_machine == 'x86_64' and sys_platform == 'linux'"]

[[package]]
name = "torch"
version = "2.10.0"
source = { registry = "https://pypi.org/simple" }

[[package]]
name = "nvidia-nccl-cu12"
version = "2.27.5"
source = { registry = "https://pypi.org/simple" }

[[package]]
name = "ai2-olmo-core"
version = "2.5.0"
source = { git = "https://github.com/allenai/OLMo-core.git?rev=fa6c501" }

[[package]]
name = "open-instruct"
source = { editable = "." }
'''


def test_the_lock_becomes_constraints(tmp_path):
    lock = tmp_path / "uv.lock"
    lock.write_text(LOCK)
    text = uv_lock.constraints(lock, ("torch", "nvidia-*"), ("torch==2.13.0",))
    assert text.splitlines() == ["torch==2.13.0", "deepspeed==0.18.4", "protobuf==6.33.5"]


def test_a_package_without_a_linux_x86_version_is_an_error(tmp_path):
    lock = tmp_path / "uv.lock"
    lock.write_text(LOCK.replace("platform_machine == 'x86_64' and sys_platform == 'linux'", "sys_platform == 'win32'"))
    with pytest.raises(ValueError, match="protobuf: 2 versions"):
        uv_lock.pins(lock)


def test_the_vllm_stand_in_answers_imports_and_refuses_use():
    assert "vllm" not in sys.modules
    with open_instruct_vllm.installed():
        import vllm
        from vllm.v1.kv_cache_interface import MambaSpec

        MambaSpec.__dataclass_fields__["dtypes"].type = tuple  # what open-instruct's vllm_utils.py does
        assert vllm.SamplingParams is vllm.SamplingParams  # one dummy per name
        assert vllm.config.VllmConfig | None is vllm.config.VllmConfig  # annotations evaluate
        with pytest.raises(RuntimeError, match="vllm.SamplingParams was used"):
            vllm.SamplingParams(n=1)
    assert "vllm" not in sys.modules and "vllm.v1.kv_cache_interface" not in sys.modules
    with pytest.raises(ImportError):
        import vllm  # noqa: F401,F811
