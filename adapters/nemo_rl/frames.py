"""The one place the adapter reads NeMo-RL's stack frames: the worker's ``train`` call, seen from inside.

Why frames at all: a policy worker runs as a Ray actor, and Ray builds the actor's class when
the worker module is imported (``@ray.remote``), copying every method into the class it ships
to the actor by value. A wrapper put on ``DTensorPolicyWorkerV2Impl.train`` (or the Megatron
worker's, or v0.5.0's ``@ray.remote`` class itself) afterwards never runs in the actor. What
does run there are the wrappers of the names ``train`` calls and looks up again in the actor
(the worker module's ``process_global_batch``, ``get_microbatch_iterator``, ...; v0.5.0:
``BatchedDataDict``'s iterators). They get their own call's arguments, not ``train``'s: the
worker (``self``), ``eval_mode``, v0.5.0's ``loss_fn`` and number of global batches are read
from the ``train`` frame that called them, here and nowhere else. The frame also tells a call
that still runs from one that raised (:func:`running`), and where a wrapper is called from
(``get_logprobs`` and ``score`` use the same names and must see every row).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any

#: The DTensor policy worker v2's source file (every tag).
DTENSOR_WORKER_FILE = "dtensor_policy_worker_v2.py"
#: The Megatron policy worker's source file (v0.6.0+).
MEGATRON_WORKER_FILE = "megatron_policy_worker.py"
#: main's split train step (``begin_train_step`` / ``train_microbatch`` / ``finish_train_step``): the
#: Megatron worker's method that asks ``get_microbatch_iterator`` there, with no ``process_global_batch``.
SPLIT_STEP_BODY = "_train_microbatch_body"
#: How far above the asking function the upstream caller may be: the helper that asks, the patching
#: layer's record call, its call-site trampoline and wrapt's pure-Python fallback add frames.
_REACH = 6


@dataclass(frozen=True)
class TrainFrame:
    """A worker's running ``train`` call, as its frame shows it.

    :ivar key: ``(id, code)`` of the frame (:func:`running` finds it again).
    :ivar worker: ``self``; :ivar loss_fn: the loss object ``train`` received;
    :ivar eval_mode: an evaluation call (no optimizer step); :ivar global_batches: ``num_global_batches``
        where ``train`` has that local (v0.5.0), else 1.
    """

    key: tuple[int, Any]
    worker: Any
    loss_fn: Any
    eval_mode: bool
    global_batches: int


def _caller_named(name: str, source_file: str) -> FrameType | None:
    frame = sys._getframe(2)  # the asking wrapper's (or helper's) frame
    for _ in range(_REACH):
        if frame is None:
            return None
        if frame.f_code.co_name == name and frame.f_code.co_filename.endswith(source_file):
            return frame
        frame = frame.f_back
    return None


def train_frame(worker_file: str = DTENSOR_WORKER_FILE) -> TrainFrame | None:
    """The worker's ``train`` call (in ``worker_file``) that called the asking wrapper, or ``None``
    (called from elsewhere: ``get_logprobs``, ``score``, another worker)."""
    frame = _caller_named("train", worker_file)
    if frame is None:
        return None
    local = frame.f_locals
    return TrainFrame(key=(id(frame), frame.f_code), worker=local.get("self"), loss_fn=local.get("loss_fn"),
                      eval_mode=bool(local.get("eval_mode", False)),
                      global_batches=int(local.get("num_global_batches", 1) or 1))


def split_step_loss_fn() -> tuple[bool, Any]:
    """``(True, loss_fn)`` when the asking wrapper runs in a micro-batch of main's Megatron split train
    step (its ``state["loss_fn"]``), else ``(False, None)``."""
    frame = _caller_named(SPLIT_STEP_BODY, MEGATRON_WORKER_FILE)
    if frame is None:
        return False, None
    return True, (frame.f_locals.get("state") or {}).get("loss_fn")


def running(key: tuple[int, Any]) -> bool:
    """Whether the frame ``key`` (:attr:`TrainFrame.key`) is on this thread's stack: its call has
    neither returned nor raised."""
    frame = sys._getframe(1)
    while frame is not None:
        if (id(frame), frame.f_code) == key:
            return True
        frame = frame.f_back
    return False
