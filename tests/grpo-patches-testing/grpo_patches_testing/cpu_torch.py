"""One CUDA-to-CPU shim for the kit's CPU runs of the frameworks' real code, written once and undoable.

NeMo-RL, megatron-core and open-instruct place tensors on ``"cuda"`` and ask ``torch.cuda`` about
memory, devices and NVTX ranges; on a CPU machine each kit runner (``nemo_rl_cpu``,
``nemo_rl_startup/nemo_e2e_cpu``, ``tests/helpers/megatron_cpu_shim``, ``open_instruct_cpu``,
``verl_cpu_shim``) takes from here what its framework needs:

* :func:`cpu_device`: the one map of a CUDA placement (``"cuda:0"``, ``torch.device("cuda")``,
  a device index) to the CPU;
* :func:`cuda_to_cpu_mode`: a torch function mode sending every CUDA placement of a torch call there;
  :func:`factories_on_cpu` does the same by rebinding torch's factories and ``Tensor.to`` (for
  processes whose framework runs its calls on threads a mode does not reach);
* :func:`answer_cuda_queries` (:func:`cuda_queries`), :func:`cuda_is_identity`, :func:`nvtx_noops`:
  ``torch.cuda`` queries answered from one table, ``.cuda()`` as the identity, NVTX ranges as no-ops.

Every change goes through a :class:`Rebinding`, which remembers what was there: ``undo()``
restores each attribute exactly (an attribute a class only inherited is deleted again) and
leaves the modes it entered. Nothing here ships in the wheel; nothing patches what grpo_patches
patches. This module imports no framework and is importable without the kit installed (the
NeMo-RL end-to-end start-up hook loads it in Ray workers' own venvs).
"""

from __future__ import annotations

import functools
from typing import Any

_MISSING = object()

#: What ``torch.cuda``'s queries answer on a CPU (each runner names the ones its framework asks).
CUDA_ANSWERS: dict[str, Any] = {
    "current_device": 0, "device_count": 1, "set_device": None, "synchronize": None, "empty_cache": None,
    "get_device_name": "cpu-shim", "memory_allocated": 0, "max_memory_allocated": 0, "memory_reserved": 0,
    "max_memory_reserved": 0, "reset_peak_memory_stats": None, "mem_get_info": (8 << 30, 8 << 30),
    "manual_seed": None, "manual_seed_all": None,
}

#: torch's factories that take ``device=``.
FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like",
             "full_like", "rand", "randn", "randint", "as_tensor", "linspace", "empty_strided")


class Rebinding:
    """Attributes set for a CPU run, each remembered so that :meth:`undo` puts back what was there."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, Any, Any, bool]] = []  # (owner, name, what was there, a mapping item)
        self._modes: list[Any] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, vars(owner).get(name, _MISSING), False))  # its own attribute, or none
        setattr(owner, name, value)

    def set_item(self, mapping: dict, key: Any, value: Any) -> None:
        """``mapping[key] = value`` (``sys.modules`` entries, registries), undone the same way."""
        self._saved.append((mapping, key, mapping.get(key, _MISSING), True))
        mapping[key] = value

    def enter(self, mode: Any) -> Any:
        """Enter a torch function mode until :meth:`undo`."""
        mode.__enter__()
        self._modes.append(mode)
        return mode

    @property
    def active(self) -> bool:
        return bool(self._saved or self._modes)

    def undo(self) -> None:
        while self._modes:
            self._modes.pop().__exit__(None, None, None)
        while self._saved:
            owner, name, value, item = self._saved.pop()
            if item and value is _MISSING:
                del owner[name]
            elif item:
                owner[name] = value
            elif value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)

    def __enter__(self) -> Rebinding:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.undo()


def cpu_device(device: Any) -> Any:
    """A CUDA placement (a ``"cuda..."`` string, a CUDA ``torch.device``, a device index) as the CPU."""
    import torch

    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    return device


def _on_cpu_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {n: cpu_device(v) if n == "device" else v for n, v in kwargs.items()}


def cuda_to_cpu_mode() -> Any:
    """A torch function mode: every CUDA placement of a torch call goes to the CPU
    (``device=``, ``Tensor.to``), ``Tensor.cuda()`` is the identity."""
    return _mode_class()()


@functools.cache
def _mode_class() -> type:
    import torch
    from torch.overrides import TorchFunctionMode

    class CudaToCpu(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            if func is torch.Tensor.cuda:
                return args[0]
            kwargs = _on_cpu_kwargs(dict(kwargs or {}))
            if func is torch.Tensor.to:
                args = tuple(cpu_device(a) for a in args)
            return func(*args, **kwargs)

    return CudaToCpu


def factories_on_cpu(rebinding: Rebinding, torch: Any, *, drop_pin_memory: bool = False) -> None:
    """torch's factories and ``Tensor.to`` place CUDA requests on the CPU (``drop_pin_memory``: and pin nothing)."""
    def on_cpu(fn: Any) -> Any:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if "device" in kwargs:
                kwargs["device"] = cpu_device(kwargs["device"])
            if drop_pin_memory:
                kwargs.pop("pin_memory", None)
            return fn(*args, **kwargs)

        return call

    for name in FACTORIES:
        rebinding.set(torch, name, on_cpu(getattr(torch, name)))
    to = torch.Tensor.to
    rebinding.set(torch.Tensor, "to", lambda self, *a, **k: to(self, *[cpu_device(x) for x in a], **_on_cpu_kwargs(k)))


def cuda_is_identity(rebinding: Rebinding, torch: Any, *, tensor: bool = True, pin_memory: bool = False) -> None:
    """``Module.cuda()`` (and ``Tensor.cuda()``, ``Tensor.pin_memory()`` where asked) return their object."""
    rebinding.set(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    if tensor:
        rebinding.set(torch.Tensor, "cuda", lambda self, *a, **k: self)
    if pin_memory:
        rebinding.set(torch.Tensor, "pin_memory", lambda self, *a, **k: self)


def cuda_queries(**overrides: Any) -> dict[str, Any]:
    """:data:`CUDA_ANSWERS` as functions (any arguments, the value back), ``overrides`` replacing values."""
    return {name: (lambda *a, _v=value, **k: _v) for name, value in {**CUDA_ANSWERS, **overrides}.items()}


def answer_cuda_queries(rebinding: Rebinding, torch: Any, names: tuple[str, ...]) -> None:
    """``torch.cuda.<name>(...)`` answers :data:`CUDA_ANSWERS`' value for each of ``names``."""
    queries = cuda_queries()
    for name in names:
        rebinding.set(torch.cuda, name, queries[name])


def nvtx_noops(rebinding: Rebinding, torch: Any, *, always: bool = False) -> None:
    """NVTX ranges do nothing where this torch has no NVTX (CPU wheels), or ``always``."""
    if not always:
        try:
            torch.cuda.nvtx.range_push("probe")
            torch.cuda.nvtx.range_pop()
            return
        except Exception:  # noqa: BLE001
            pass
    try:
        nvtx = torch.cuda.nvtx
    except Exception:  # noqa: BLE001
        return
    rebinding.set(nvtx, "range_push", lambda *a, **k: None)
    rebinding.set(nvtx, "range_pop", lambda *a, **k: None)
