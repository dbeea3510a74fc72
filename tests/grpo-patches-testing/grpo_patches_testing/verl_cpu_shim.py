"""The smallest CPU platform for verl's engine line (0.9 ships cuda / npu / rocm platforms only;
0.8 asks ``torch.<device>`` directly: :func:`_install_08`). For the tests and the benchmarks.

verl 0.9 resolves every device call through ``verl.plugin.platform.get_platform()``, so one
registered ``PlatformBase`` subclass plus ``set_platform`` is the whole shim; no verl function
is patched. ``VERL_ENGINE_DEVICE=cuda`` makes ``EngineRegistry`` hand out the FSDP engine
classes (registered for cuda / npu only). Use ``strategy="fsdp2"`` (FSDP1 insists on a CUDA
``device_id``). Call :func:`install` before anything calls ``get_platform()``.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import os
import sys
import types

import torch

from grpo_patches_testing import cpu_torch

#: What :func:`install` sets outside verl's own registries (:func:`uninstall` puts it back).
SHIM = cpu_torch.Rebinding()


def _device_module() -> types.SimpleNamespace:
    """The ``torch.<device>`` calls verl makes outside offload paths: :data:`cpu_torch.CUDA_ANSWERS`,
    but ``current_device()`` is a ``.to()`` target ("cpu"), ``get_device_name()`` keys verl's flops
    table ("CPU": its CPU figure for MFU) and seeding seeds torch's CPU generator."""
    return types.SimpleNamespace(**{
        **cpu_torch.cuda_queries(current_device="cpu", get_device_name="CPU"),
        "manual_seed": torch.manual_seed, "manual_seed_all": torch.manual_seed, "is_available": lambda: True,
        "get_rng_state": torch.get_rng_state, "set_rng_state": torch.set_rng_state, "Stream": None, "Event": None,
    })


def _install_08() -> None:
    """verl 0.8 has no platform plugins: it asks ``torch.<device>`` directly (device "cpu" here),
    and registers the FSDP engines for cuda / npu only."""
    from verl.workers.engine.base import EngineRegistry

    import verl.workers.engine.fsdp.transformer_impl  # noqa: F401  (registers the engines)

    for name, fn in vars(_device_module()).items():  # the torch.cuda calls torch.cpu lacks
        if fn is not None and not hasattr(torch.cpu, name):
            SHIM.set(torch.cpu, name, fn)
    # unpadding imports flash_attn.bert_padding off NPU: its pure-torch twin (verl's NPU copy) stands in
    try:
        from verl.utils import npu_flash_attn_utils as pure
    except ImportError:  # 0.6.1 has no such copy (its legacy Megatron worker, the one run there, needs none)
        pure = None
    if pure is not None and "flash_attn" not in sys.modules:
        package, padding = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.bert_padding")
        package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
        padding.__spec__ = importlib.machinery.ModuleSpec("flash_attn.bert_padding", None)
        for name in ("index_first_axis", "pad_input", "rearrange", "unpad_input"):
            setattr(padding, name, getattr(pure, name))
        package.bert_padding = padding
        SHIM.set_item(sys.modules, "flash_attn", package)
        SHIM.set_item(sys.modules, "flash_attn.bert_padding", padding)
    for backends in EngineRegistry._engines.values():
        for devices in backends.values():
            if "cuda" in devices:
                devices.setdefault("cpu", devices["cuda"])


def install(ray_resource: str = "CPU") -> None:
    """Register and select the CPU platform. ``ray_resource``: the Ray resource verl asks for per
    worker (``"GPU"`` for a trainer run, whose resource pools count GPU/NPU resources only: the
    cluster then offers logical GPUs)."""
    try:
        import verl.plugin.platform  # noqa: F401  (0.9+)
    except ImportError:
        return _install_08()
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform

    module = _device_module()

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = "cpu"
        vendor_name = "cpu"
        device_module = module

        def is_available(self):
            return True

        def current_device(self):
            return "cpu"  # used as a .to() target: micro_batch.to(get_device_id())

        def device_count(self):
            return 1

        def set_device(self, device_index):
            return None

        def synchronize(self, device_index=None):
            return None

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            return None

        def empty_cache(self):
            return None

        def get_device_capability(self, device_index=0):
            return (None, None)

        def communication_backend_name(self):
            return "gloo"

        def visible_devices_envvar(self):
            return "CUDA_VISIBLE_DEVICES"

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

        def profiler_start(self):
            return None

        def profiler_stop(self):
            return None

        def ray_resource_name(self):
            return ray_resource

        def ray_noset_envvars(self):
            return []

        def is_ipc_supported(self):
            return False

        def cudart(self):
            return None

    set_platform(PlatformCPU())
    if "VERL_ENGINE_DEVICE" not in os.environ:
        SHIM.set_item(os.environ, "VERL_ENGINE_DEVICE", "cuda")  # pick the FSDP engine classes


def uninstall() -> None:
    """Undo what :func:`install` set in torch, ``sys.modules`` and the environment. What it registered
    with verl (the CPU platform, the engines' ``cpu`` entries) is verl's state for the process: it
    selects nothing once verl is asked for another platform."""
    SHIM.undo()
