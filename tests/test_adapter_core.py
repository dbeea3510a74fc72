"""The core pieces every adapter stands on: the adapter handle, the per-call context, the call
binder, the row merge and the round-up rule (each written once, for every adapter)."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass

import pytest
import torch

import grpo_patches
from grpo_patches import call_args
from grpo_patches.adapter_handle import AdapterHandle
from grpo_patches.call_context import CallSlot
from grpo_patches.errors import IncompatibleOptionsError
from grpo_patches.row_merge import merge_rows, round_up
from tests.helpers.fakefw_site import make_site


@dataclass
class Update:
    rows: int = 0


SLOT: CallSlot[Update] = CallSlot("test.update")


def test_a_call_slot_holds_the_context_of_the_enclosing_call_only():
    assert SLOT.current() is None
    with SLOT.entered(Update(1)) as outer:
        assert SLOT.current() is outer
        with SLOT.entered(Update(2)) as inner:
            assert SLOT.current() is inner
        assert SLOT.current() is outer
    assert SLOT.current() is None
    with pytest.raises(RuntimeError):
        with SLOT.entered(Update(3)):
            raise RuntimeError("reset on the way out, whatever the exception")
    assert SLOT.current() is None


def test_the_outermost_wrapper_creates_the_context_and_inner_ones_join_it():
    made = []

    def factory():
        made.append(Update())
        return made[-1]

    with SLOT.joined(factory) as outer:
        with SLOT.joined(factory) as inner:
            assert inner is outer
    assert len(made) == 1 and SLOT.current() is None


def test_a_call_slot_is_per_thread():
    seen = []
    with SLOT.entered(Update(1)):
        thread = threading.Thread(target=lambda: seen.append(SLOT.current()))
        thread.start()
        thread.join()
    assert seen == [None]


class Engine:
    def forward_backward_batch(self, data, loss_function=None, forward_only=False, **extra):
        return data, loss_function, forward_only, extra


def _nvtx(function):  # a decorator without functools.wraps (NeMo-RL's @wrap_with_nvtx_name)
    def inner(*args, **kwargs):
        return function(*args, **kwargs)
    return inner


class Worker:
    @_nvtx
    def train(self, data, loss_fn, eval_mode=False, *, gbs=None):
        return data, loss_fn, eval_mode, gbs


def test_bind_reads_a_call_by_the_wrapped_functions_own_parameter_names():
    engine = Engine()
    bound = call_args.bind(engine.forward_backward_batch, ("d",), {"forward_only": True, "x": 1})
    assert dict(bound) == {"data": "d", "loss_function": None, "forward_only": True, "extra": {"x": 1}}
    assert bound.call(engine.forward_backward_batch, data="e") == ("e", None, True, {"x": 1})
    assert bound.changed(loss_function=len) == (("d", len, True), {"x": 1})
    with pytest.raises(TypeError, match="not parameters"):
        bound.changed(nope=1)
    worker = Worker()
    bound = call_args.bind(worker.train, ("d", "loss"), {"gbs": 4})
    assert dict(bound) == {"data": "d", "loss_fn": "loss", "eval_mode": False, "gbs": 4}
    assert bound.call(worker.train, eval_mode=True) == ("d", "loss", True, 4)
    assert dict(call_args.bind(lambda a, b=2: None, (1,), {})) == {"a": 1, "b": 2}
    with pytest.raises(TypeError):
        call_args.bind(engine.forward_backward_batch, (), {})  # as the call itself would


def test_merge_rows_puts_kept_and_dropped_rows_back_with_gradients_through_the_kept_ones():
    kept = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    keep, drop = torch.tensor([2, 0]), torch.tensor([1])
    merged = merge_rows(kept, keep, 3, dropped=torch.tensor([[9.0, 9.0]]), drop=drop)
    assert merged.tolist() == [[3.0, 4.0], [9.0, 9.0], [1.0, 2.0]]
    merged.sum().backward()
    assert kept.grad.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    filled = merge_rows(kept.detach(), keep, 3, fill=torch.full((3, 2), 7.0))
    assert filled.tolist() == [[3.0, 4.0], [7.0, 7.0], [1.0, 2.0]]
    assert merge_rows(kept.detach(), keep, 3).tolist() == [[3.0, 4.0], [0.0, 0.0], [1.0, 2.0]]
    assert merge_rows(None, keep, 3) is None
    jagged = torch.nested.nested_tensor_from_jagged(torch.arange(5.0), offsets=torch.tensor([0, 2, 5]))
    other = torch.nested.nested_tensor_from_jagged(torch.tensor([8.0]), offsets=torch.tensor([0, 1]))
    out = merge_rows(jagged, torch.tensor([0, 2]), 3, dropped=other, drop=torch.tensor([1]))
    assert [r.tolist() for r in out.unbind()] == [[0.0, 1.0], [8.0], [2.0, 3.0, 4.0]]


def test_round_up_is_the_one_multiple_rule():
    assert [round_up(n, 4) for n in (0, 1, 4, 5)] == [0, 4, 4, 8]
    assert round_up(3, 0) == 3 and round_up(3, 1) == 3


@pytest.fixture
def fakefw(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(make_site(tmp_path)))
    yield
    grpo_patches.disable()
    for name in [m for m in sys.modules if m.startswith("fakefw")]:
        del sys.modules[name]


def test_the_adapter_handle_answers_for_its_framework(fakefw):
    handle = AdapterHandle("fakefw")
    assert handle.options is None and not handle.enabled and not handle.on("recompute")
    assert handle.setting("tile_size", 5) == 5
    grpo_patches.enable("fakefw", tiled_loss="auto", tile_size=3)
    assert handle.enabled and handle.on("recompute") and handle.on("tiled_loss") and not handle.on("verify_every")
    assert handle.setting("tile_size") == 3 and not handle.strict("tiled_loss")
    assert handle.refuse_or_note("tiled_loss", ["no way"]) is False
    assert grpo_patches.status()["fakefw"]["notes"]["tiled_loss"] == "off: no way"
    handle.note("why", "because", owner=Engine())
    assert grpo_patches.status()["fakefw"]["by_class"][f"{__name__}.Engine"] == {"why": "because"}
    handle.switch_off("tiled_loss", "verify found a difference")
    assert not handle.on("tiled_loss")
    engine = Engine()
    assert handle.state_of(engine, Update) is handle.state_of(engine, Update) and handle.peek(engine) is not None
    assert not handle.passing_through
    with handle.unpatched():
        assert handle.passing_through
    grpo_patches.enable("fakefw", tiled_loss=True)
    with pytest.raises(IncompatibleOptionsError, match="tiled_loss=True: no way"):
        handle.refuse_or_note("tiled_loss", "no way")
    assert handle.peek(engine) is None  # enable with new options started fresh
