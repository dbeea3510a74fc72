"""The test kit's CUDA-to-CPU shim (grpo_patches_testing.cpu_torch): one shim for every CPU runner, undoable.

Each runner's install puts CUDA placements on the CPU; its undo leaves torch exactly as it found it
(every attribute the same object, attributes a class only inherited inherited again)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed

from grpo_patches_testing import cpu_torch, nemo_rl_cpu
from grpo_patches_testing.nemo_rl_startup import nemo_e2e_cpu

NAMESPACES = {"torch": torch, "torch.cuda": torch.cuda, "torch.cuda.nvtx": torch.cuda.nvtx, "torch.Tensor": torch.Tensor,
              "torch.nn.Module": torch.nn.Module, "torch.distributed": torch.distributed}


def _snapshot() -> list[dict[str, object]]:
    return [dict(vars(ns)) for ns in NAMESPACES.values()]


def _changed(before: list[dict[str, object]]) -> list[str]:
    return [f"{label}.{name}" for (label, ns), old in zip(NAMESPACES.items(), before, strict=True)
            for name in set(old) | set(vars(ns)) if old.get(name, "-") is not vars(ns).get(name, "-")]


def _placements_on_cpu() -> None:
    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.ones(2).to("cuda:0").device.type == "cpu"
    assert torch.nn.Linear(2, 2).cuda().weight.device.type == "cpu"
    assert torch.cuda.memory_allocated() == 0 and torch.cuda.current_device() == 0


def test_the_nemo_rl_shim_places_on_the_cpu_and_its_undo_leaves_torch_as_it_was():
    before = _snapshot()
    nemo_rl_cpu.install_cpu_shim()
    try:
        _placements_on_cpu()
        assert "torch.zeros" in _changed(before)
        nemo_rl_cpu.install_cpu_shim()  # idempotent: nothing set twice
    finally:
        nemo_rl_cpu.uninstall_cpu_shim()
    assert _changed(before) == []
    assert "pin_memory" not in vars(torch.Tensor) or before[3].get("pin_memory") is vars(torch.Tensor)["pin_memory"]


def test_the_end_to_end_shim_undoes_what_its_post_import_hooks_set(monkeypatch):
    before = _snapshot()
    nemo_e2e_cpu._cpu_torch(torch)
    try:
        _placements_on_cpu()
        assert torch.ones(2).pin_memory().device.type == "cpu"
        assert "torch.Tensor.pin_memory" in _changed(before)  # inherited from TensorBase: set on Tensor itself
    finally:
        nemo_e2e_cpu.uninstall()
    assert _changed(before) == []
    assert "pin_memory" not in vars(torch.Tensor)  # inherited again


def test_a_mode_and_mapping_items_are_undone_too(monkeypatch):
    monkeypatch.delenv("GRPO_PATCHES_TEST_KEY", raising=False)
    shim = cpu_torch.Rebinding()
    with shim:
        shim.enter(cpu_torch.cuda_to_cpu_mode())
        shim.set_item(os.environ, "GRPO_PATCHES_TEST_KEY", "1")
        shim.set_item(sys.modules, "grpo_patches_test_stand_in", sys)
        assert torch.empty(1, device=torch.device("cuda")).device.type == "cpu"
        assert torch.ones(1).cuda().device.type == "cpu"
    assert "GRPO_PATCHES_TEST_KEY" not in os.environ and "grpo_patches_test_stand_in" not in sys.modules
    assert not shim.active
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(1, device="cuda")


def test_a_change_made_outside_the_rebinding_is_seen_by_the_check():
    """The planted fault: an attribute set directly is never undone, and the snapshot check says which."""
    before = _snapshot()
    original = torch.cuda.empty_cache
    shim = cpu_torch.Rebinding()
    shim.set(torch.cuda, "synchronize", lambda *a, **k: None)
    torch.cuda.empty_cache = lambda *a, **k: None  # not through the rebinding
    try:
        shim.undo()
        assert _changed(before) == ["torch.cuda.empty_cache"]
    finally:
        torch.cuda.empty_cache = original
    assert _changed(before) == []


def test_one_cuda_to_cpu_map():
    assert cpu_torch.cpu_device("cuda:1") == "cpu" and cpu_torch.cpu_device(0) == "cpu"
    assert cpu_torch.cpu_device(torch.device("cuda")) == torch.device("cpu")
    assert cpu_torch.cpu_device("cpu") == "cpu" and cpu_torch.cpu_device(True) is True
    assert cpu_torch.cpu_device(torch.float32) is torch.float32
