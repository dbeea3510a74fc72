"""A schedule simulator of TRL's ``GRPOTrainer`` on the HF ``Trainer``, with a brute-force oracle.

It lays out micro-steps, gradient-accumulation windows, generations and consumptions the way
trl 1.16 / transformers 5.23 do, tracks the weight version (optimizer steps done) of every
micro-step, and says per rollout whether some consumption saw other weights than the
generation did (then old log-probs are really needed). Modelled, by function name:

- ``Trainer.set_initial_training_values``: ``steps_in_epoch = len(train_dataloader)``;
  ``num_update_steps_per_epoch = ceil(steps_in_epoch / GA)``; with ``max_steps`` the epoch
  count is ``ceil(max_steps / num_update_steps_per_epoch)``.
- ``Trainer._run_epoch``: the epoch is cut into windows of ``GA`` batches, the last one
  ``steps_in_epoch % GA`` (or ``GA``); ``current_gradient_accumulation_steps =
  len(batch_samples)``; ``do_sync_step = (step + 1) % GA == 0 or step + 1 == steps_in_epoch``
  (``step`` counts micro-steps within the epoch); after a synced micro-step the optimizer
  steps and ``state.global_step += 1``; ``on_step_begin`` fires when ``step % GA == 0``.
- ``DefaultFlowCallback.on_step_end``: training stops once ``global_step >= max_steps``.
- ``Trainer._init_training_state`` + ``_run_epoch`` on ``resume_from_checkpoint``:
  ``epochs_trained = global_step // num_update_steps_per_epoch``; the first
  ``(global_step % num_update_steps_per_epoch) * GA`` batches of that epoch are skipped
  (``skip_first_batches``) and ``step`` restarts after them, so windows stay epoch-aligned.
- ``GRPOTrainer.__init__``: ``_step = 0`` and ``_buffered_inputs = None``; neither is
  checkpointed, so a resumed run (a new trainer) restarts both.
- ``GRPOTrainer._prepare_inputs``: generates when ``_step % (spg * num_iterations) == 0 or
  _buffered_inputs is None`` and serves slices of that rollout until the next generation.
- ``GRPOTrainer.training_step``: ``_step += 1`` after each micro-step.
- ``GRPOTrainer._get_train_sampler`` / ``RepeatSampler.__len__``: an epoch has
  ``prompt_chunks * spg * num_iterations`` micro-steps, a multiple of ``spg * num_iterations``.
  The simulator accepts any epoch length (custom samplers, other frameworks); see
  :func:`trl_steps_per_epoch` for TRL's own.
- ``GRPOTrainer._generate_and_score_completions``: TRL's own decision
  (:func:`trl_modulo_rule`).

A resumed schedule describes only the ``train(resume_from_checkpoint=...)`` call: the
interrupted run's rollouts are those of the uninterrupted schedule before that point.
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_patches.recompute import require_count, cap_consumptions, window_steps_left

__all__ = [
    "MicroStep",
    "Rollout",
    "Schedule",
    "simulate",
    "hf_micro_steps_left",
    "trl_steps_per_epoch",
    "trl_modulo_rule",
    "issue_5770_rule",
]


@dataclass(frozen=True)
class MicroStep:
    """One forward/backward pass of the HF training loop."""

    index: int  # micro-steps before this one in an uninterrupted run (same numbering after a resume)
    epoch: int
    step_in_epoch: int  # ``step`` of ``Trainer._run_epoch``
    trl_step: int  # ``GRPOTrainer._step`` while this micro-step runs (restarts at 0 on resume)
    index_in_window: int
    window_length: int  # ``current_gradient_accumulation_steps``
    version: int  # optimizer steps done before this micro-step (``state.global_step``)
    optimizer_steps_after: bool  # ``do_sync_step``


@dataclass(frozen=True)
class Rollout:
    """One generation and every micro-step that consumes it."""

    generated_at: int  # MicroStep.index; the generating micro-step is also the first consumer
    trl_step: int  # ``_step`` at generation: ``a`` of TRL issue #5770
    generate_every: int  # spg * num_iterations
    consumed_at: tuple[int, ...]  # MicroStep.index of every consumption, in order
    consumptions_left: int  # rule input, computed as an adapter would (formula, not counted)
    window_steps_left: int  # rule input
    version_at_generation: int
    versions_at_consumption: tuple[int, ...]

    @property
    def recompute_needed(self) -> bool:
        """The oracle: some consumption sees other weights than the generation did."""
        return any(v != self.version_at_generation for v in self.versions_at_consumption)

    @property
    def planned_last_trl_step(self) -> int:
        """``b`` of TRL issue #5770: the last ``_step`` of this rollout's generation period."""
        return (self.trl_step // self.generate_every + 1) * self.generate_every - 1


@dataclass(frozen=True)
class Schedule:
    """What one ``train()`` call does, micro-step by micro-step."""

    gradient_accumulation_steps: int
    steps_per_generation: int
    num_iterations: int
    steps_per_epoch: int
    max_steps: int  # optimizer steps at which training stops
    resume_at_optimizer_step: int | None
    micro_steps: tuple[MicroStep, ...]
    rollouts: tuple[Rollout, ...]

    @property
    def generate_every(self) -> int:
        return self.steps_per_generation * self.num_iterations


def trl_steps_per_epoch(prompt_chunks: int, steps_per_generation: int, num_iterations: int) -> int:
    """Micro-steps per epoch of stock TRL: the RepeatSampler repeats each chunk of
    ``generation_batch_size`` prompts ``spg * num_iterations`` times, one batch per micro-step."""
    require_count("prompt_chunks", prompt_chunks)
    return prompt_chunks * steps_per_generation * num_iterations


def hf_micro_steps_left(
    global_step: int, max_steps: int, window_steps_left: int, gradient_accumulation_steps: int, steps_in_epoch: int
) -> int:
    """Micro-steps left in training, counting the current one, seen from inside a window.

    ``global_step`` counts optimizer steps done (the current window ends step
    ``global_step + 1``); later windows are ``GA`` long except each epoch's last. Valid for
    a fresh run and a data-skipping resume, not for ``ignore_data_skip=True`` (the epoch then
    restarts from its first batch while ``global_step`` does not).
    """
    ga = gradient_accumulation_steps
    per_epoch = -(-steps_in_epoch // ga)  # num_update_steps_per_epoch
    last_len = steps_in_epoch % ga or ga
    first, stop = global_step + 1, max_steps  # 0-based indices of the later optimizer steps
    later = max(stop - first, 0)
    # optimizer step j ends an epoch iff j % per_epoch == per_epoch - 1; count those in [first, stop)
    epoch_ends = (stop // per_epoch - first // per_epoch) if later else 0
    return window_steps_left + later * ga - epoch_ends * (ga - last_len)


def trl_modulo_rule(gradient_accumulation_steps: int, steps_per_generation: int, num_iterations: int) -> bool:
    """TRL 0.20-1.16 (``_generate_and_score_completions``): one decision for every rollout."""
    return gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0


def issue_5770_rule(gradient_accumulation_steps: int, rollout: Rollout) -> bool:
    """The window formula proposed in TRL issue #5770: ``a // GA != b // GA`` on ``_step``."""
    ga = gradient_accumulation_steps
    return rollout.trl_step // ga != rollout.planned_last_trl_step // ga


def simulate(
    gradient_accumulation_steps: int,
    steps_per_generation: int,
    num_iterations: int,
    steps_per_epoch: int,
    num_epochs: int = 1,
    resume_at_optimizer_step: int | None = None,
    max_steps: int | None = None,
) -> Schedule:
    """Simulate one ``GRPOTrainer.train()`` call (single process; every rank does the same).

    :param steps_per_epoch: micro-steps (dataloader batches) per epoch, ``len(train_dataloader)``.
    :param num_epochs: epochs to train (ignored when ``max_steps`` is given, as in HF).
    :param resume_at_optimizer_step: simulate ``train(resume_from_checkpoint=...)`` from the
        checkpoint saved after that many optimizer steps (``1 <= value < max_steps``).
    :param max_steps: optimizer steps to train (``TrainingArguments.max_steps``).
    """
    ga = require_count("gradient_accumulation_steps", gradient_accumulation_steps)
    spg = require_count("steps_per_generation", steps_per_generation)
    ni = require_count("num_iterations", num_iterations)
    require_count("steps_per_epoch", steps_per_epoch)
    updates_per_epoch = -(-steps_per_epoch // ga)
    if max_steps is None:
        max_steps = require_count("num_epochs", num_epochs) * updates_per_epoch
        epochs = num_epochs
    else:
        epochs = -(-require_count("max_steps", max_steps) // updates_per_epoch)
    last_len = steps_per_epoch % ga or ga

    global_step, first_epoch, skipped = 0, 0, 0
    if resume_at_optimizer_step is not None:
        r = require_count("resume_at_optimizer_step", resume_at_optimizer_step)
        if r >= max_steps:
            raise ValueError(
                f"resume_at_optimizer_step={r} must be < max_steps={max_steps}: nothing is left to train."
            )
        global_step, first_epoch, skipped = r, r // updates_per_epoch, (r % updates_per_epoch) * ga

    micro: list[MicroStep] = []
    trl_step = 0  # a new trainer: `_step` and `_buffered_inputs` start over
    for epoch in range(first_epoch, epochs):
        step, first_update = -1, 0
        if epoch == first_epoch and skipped:
            step, first_update = skipped - 1, skipped // ga
        for update in range(first_update, updates_per_epoch):
            length = ga if update != updates_per_epoch - 1 else last_len
            for i in range(length):
                step += 1
                sync = (step + 1) % ga == 0 or step + 1 == steps_per_epoch
                micro.append(MicroStep(epoch * steps_per_epoch + step, epoch, step, trl_step, i, length, global_step, sync))
                trl_step += 1
                global_step += int(sync)
            if global_step >= max_steps:
                break
        if global_step >= max_steps:
            break

    return Schedule(ga, spg, ni, steps_per_epoch, max_steps, resume_at_optimizer_step, tuple(micro),
                    _rollouts(micro, ga, spg * ni, steps_per_epoch, max_steps))


def _rollouts(micro: list[MicroStep], ga: int, every: int, steps_per_epoch: int, max_steps: int) -> tuple[Rollout, ...]:
    """Group micro-steps by the rollout they consume and fill in the rule's inputs."""
    groups: list[list[MicroStep]] = []
    for m in micro:
        if m.trl_step % every == 0 or not groups:  # `not groups`: `_buffered_inputs is None`
            groups.append([])
        groups[-1].append(m)
    out = []
    for g in groups:
        first = g[0]
        left_in_window = window_steps_left(first.index_in_window, first.window_length)
        left_in_training = hf_micro_steps_left(first.version, max_steps, left_in_window, ga, steps_per_epoch)
        out.append(Rollout(
            generated_at=first.index,
            trl_step=first.trl_step,
            generate_every=every,
            consumed_at=tuple(m.index for m in g),
            consumptions_left=cap_consumptions(every - first.trl_step % every, left_in_training),
            window_steps_left=left_in_window,
            version_at_generation=first.version,
            versions_at_consumption=tuple(m.version for m in g),
        ))
    return tuple(out)
