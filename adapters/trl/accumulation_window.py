"""The HF Trainer's real gradient-accumulation window, counted for the recompute decision.

Wraps ``GRPOTrainer.training_step`` (option ``recompute``) to count the micro-steps done in
the current window. The count restarts whenever ``state.global_step`` moves or a new
``TrainerState`` appears (each optimizer step, each ``train()`` call, each resume). The
window's real length is the Trainer's ``current_gradient_accumulation_steps``, derived from
the epoch length on transformers versions without it (an epoch's last window is shorter).
:mod:`.old_logprobs` reads both when a rollout is generated.
"""

from __future__ import annotations

from typing import Any, Callable

from . import state
from .state import Window


def window_index(trainer: Any) -> int:
    """0-based index of the running micro-step within its accumulation window."""
    window = state.of(trainer).window
    if window is None or window.state is not trainer.state or window.global_step != trainer.state.global_step:
        return 0
    return window.done


def training_step(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``GRPOTrainer.training_step``: count the micro-steps of the current window."""
    index = window_index(instance)
    window = Window(instance.state, instance.state.global_step, index)
    state.of(instance).window = window
    result = wrapped(*args, **kwargs)
    window.done = index + 1
    return result


def steps_in_epoch(trainer: Any) -> int:
    """Micro-steps per epoch, as the HF Trainer counts them."""
    # the HF Trainer keeps the epoch's dataloader on its callback handler (len = micro-steps)
    loader = getattr(trainer.callback_handler, "train_dataloader", None)
    try:
        return len(loader)
    except TypeError:  # no length (iterable dataset): the Trainer then uses max_steps * GA
        return trainer.state.max_steps * trainer.args.gradient_accumulation_steps


def window_length(trainer: Any, ga: int) -> int:
    """The current window's real length: the Trainer's ``current_gradient_accumulation_steps``
    (transformers >= 4.55); before that, derived the way the Trainer cuts an epoch (windows
    of GA, the epoch's last one ``steps_in_epoch % GA`` long)."""
    length = getattr(trainer, "current_gradient_accumulation_steps", None)
    if length:
        return int(length)
    epoch = steps_in_epoch(trainer)
    per_epoch = -(-epoch // ga)
    last_in_epoch = trainer.state.global_step % per_epoch == per_epoch - 1
    return (epoch % ga or ga) if last_in_epoch else ga
