"""TRL's GRPOTrainer on the demo's tiny model, patches off or on (the TRL tests and
``benchmarks/trl_filter_exactness.py``).

Stable API (the tests rely on it)::

    from grpo_patches_testing.trl_train import train
    result = train(patched=True, options={"recompute": True}, steps=4, gradient_accumulation_steps=3)
    result.weights       # {name: tensor} copy of the final state_dict
    result.log_history   # trainer.state.log_history
    result.savings       # grpo_patches.savings.totals("trl") for this run
    result.metrics(name) # the values of one logged metric, in order
    result.forwards      # with count_forwards=True: rows (and tokens) through TRL's log-prob method

Every run starts from the same saved tiny model with the same seeds, so the unpatched and
patched runs see identical data and generations; only the patches differ.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from grpo_patches_testing import scratch  # noqa: E402
from grpo_patches.demo import trl_config  # noqa: E402  (after the environment: nothing of TRL imported)

#: GRPOConfig values every run uses unless overridden: the demo's base (8 prompts x 4 generations,
#: GA=3 and steps_per_generation=2: misaligned, upstream recomputes old log-probs on every rollout).
DEFAULT_CONFIG: dict[str, Any] = {**trl_config.BASE_CONFIG, "max_completion_length": 8, "learning_rate": 5e-2,
                                  "temperature": 1.0}


@dataclass
class RunResult:
    """What one training run produced."""

    weights: dict[str, Any]
    log_history: list[dict[str, Any]]
    savings: dict[str, float]
    status: dict[str, Any]
    output_dir: str
    global_step: int
    extra: dict[str, Any] = field(default_factory=dict)

    def metrics(self, name: str) -> list[float]:
        """Every logged value of ``name`` (per logging step), in order."""
        return [row[name] for row in self.log_history if name in row]

    def notes(self, klass: str = "trl.trainer.grpo_trainer.GRPOTrainer") -> dict[str, str]:
        """The status notes of one trainer class (what ran for it)."""
        return self.status.get("by_class", {}).get(klass, {})

    @property
    def forwards(self) -> "ForwardRows":
        return self.extra["forwards"]

    def max_weight_diff(self, other: "RunResult") -> float:
        """Largest absolute difference between the final weights of two runs."""
        return max(float((self.weights[k] - other.weights[k]).abs().max()) for k in self.weights)

    def same_weights(self, other: "RunResult") -> bool:
        """Bitwise equality of the final weights."""
        import torch

        return all(torch.equal(self.weights[k], other.weights[k]) for k in self.weights)


@dataclass
class ForwardRows:
    """Rows through TRL's ``_get_per_token_logps_and_entropies``, counted beneath the patches
    (so a pass the patches answer without running it is not counted)."""

    with_grad: int = 0  # the policy forward of the loss
    with_grad_calls: int = 0
    no_grad: int = 0  # old-logprob / reference passes, and the dropped rows' metrics forward
    no_grad_calls: int = 0
    tokens: int = 0  # token positions (rows x columns) through every forward counted here


def _count_forwards(counter: ForwardRows) -> Callable[[], None]:
    """Install the counter on GRPOTrainer (before grpo_patches wraps it); returns the undo."""
    import torch
    import wrapt
    from trl.trainer.grpo_trainer import GRPOTrainer

    name = "_get_per_token_logps_and_entropies"
    original = GRPOTrainer.__dict__[name]

    def count(wrapped, instance, args, kwargs):
        model = kwargs["model"] if "model" in kwargs else args[0]
        if getattr(model, "runs_no_forward", False):  # grpo_patches' input recorder: no forward
            return wrapped(*args, **kwargs)
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[1]
        rows = int(ids.size(0))
        counter.tokens += int(ids.numel())
        if torch.is_grad_enabled():
            counter.with_grad += rows
            counter.with_grad_calls += 1
        else:
            counter.no_grad += rows
            counter.no_grad_calls += 1
        return wrapped(*args, **kwargs)

    setattr(GRPOTrainer, name, wrapt.FunctionWrapper(original, count))
    return lambda: setattr(GRPOTrainer, name, original)


def train(
    patched: bool | None,
    options: dict[str, Any] | None = None,
    steps: int = 4,
    *,
    reward_funcs: Callable | Sequence[Callable] | None = None,
    dataset: Any = None,
    num_prompts: int = 8,
    output_dir: str | None = None,
    resume_from_checkpoint: str | bool | None = None,
    plugins: Sequence[Any] = (),
    callbacks: Sequence[Any] = (),
    trainer_hook: Callable[[Any], None] | None = None,
    trainer_class: type | None = None,
    count_forwards: bool = False,
    model_path: str | None = None,
    **grpo_config_overrides: Any,
) -> RunResult:
    """Train ``steps`` optimizer steps (``max_steps``) and return the final state.

    :param patched: ``grpo_patches.enable("trl", **options)`` for the run (always disabled
        again afterwards); ``False`` runs upstream TRL; ``None`` leaves the patch state as it
        is (for runs patched by ``GRPO_PATCHES`` or an earlier ``enable``).
    :param options: options for :func:`grpo_patches.enable`.
    :param reward_funcs: reward function(s); default :func:`reward_char_sum`.
    :param dataset: a prompt dataset; default ``prompt_dataset(num_prompts)``.
    :param output_dir: where checkpoints go (a fresh temp dir by default).
    :param resume_from_checkpoint: passed to ``trainer.train``.
    :param plugins: pluggy plugins registered for the run only (e.g. to override a hook).
    :param callbacks: extra ``TrainerCallback``s.
    :param trainer_hook: called with the built trainer before training (e.g. to spy on it).
    :param trainer_class: a ``GRPOTrainer`` subclass to build instead (e.g. a custom sampler).
    :param count_forwards: count the rows through TRL's log-prob method (``result.forwards``).
    :param model_path: a saved model (with the tiny word tokenizer) instead of the tiny Qwen2.
    :param grpo_config_overrides: ``GRPOConfig`` fields overriding :data:`DEFAULT_CONFIG`.
    """
    import torch
    from trl import GRPOConfig, GRPOTrainer

    import grpo_patches
    from grpo_patches import savings
    from grpo_patches.demo import tiny_model

    config = {**DEFAULT_CONFIG, "max_steps": steps, **grpo_config_overrides}
    # transformers < 5 writes a bf16/fp16 config's precision into ACCELERATE_MIXED_PRECISION and
    # later configs without one inherit it: a bf16=False run after a default (bf16) run in the
    # same process would autocast to bf16. Each run starts from the caller's environment.
    saved_precision = os.environ.get("ACCELERATE_MIXED_PRECISION")
    config["output_dir"] = output_dir or scratch.directory("trl_run_")
    savings.reset("trl")
    pm = grpo_patches.plugin_manager()
    for plugin in plugins:
        pm.register(plugin)
    if patched is not None:
        grpo_patches.disable("trl")
    counter = ForwardRows()
    uncount = _count_forwards(counter) if count_forwards else None
    try:
        if patched:
            grpo_patches.enable("trl", **(options or {}))
        args = GRPOConfig(**config)
        path = model_path or tiny_model.tiny_model_path()
        trainer = (trainer_class or GRPOTrainer)(
            model=path,
            reward_funcs=reward_funcs if reward_funcs is not None else tiny_model.reward_char_sum,
            args=args,
            train_dataset=dataset if dataset is not None else tiny_model.prompt_dataset(num_prompts),
            processing_class=tiny_model.load_tokenizer(path),
            callbacks=list(callbacks) or None,
        )
        if trainer_hook is not None:
            trainer_hook(trainer)
        trainer.train(resume_from_checkpoint=resume_from_checkpoint)
        status = grpo_patches.status()["trl"]
        weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        return RunResult(
            weights=weights,
            log_history=list(trainer.state.log_history),
            savings=savings.totals("trl"),
            status=status,
            output_dir=config["output_dir"],
            global_step=trainer.state.global_step,
            extra={"forwards": counter},
        )
    finally:
        if saved_precision is None:
            os.environ.pop("ACCELERATE_MIXED_PRECISION", None)
        else:
            os.environ["ACCELERATE_MIXED_PRECISION"] = saved_precision
        if patched is not None:
            grpo_patches.disable("trl")
        if uncount is not None:
            uncount()
        for plugin in plugins:
            pm.unregister(plugin)
        torch.set_grad_enabled(True)


def installed_loss_types() -> set[str]:
    """The ``loss_type`` values the installed TRL's ``_compute_loss`` branches on."""
    import inspect
    import re

    from trl.trainer.grpo_trainer import GRPOTrainer

    lines = inspect.getsource(GRPOTrainer._compute_loss).splitlines()
    found: set[str] = set()
    for line in lines:
        if "loss_type ==" in line or "loss_type in" in line:  # branches, not the != guards
            found.update(re.findall(r"""["']([a-z_]+)["']""", line))
    return found


def require_loss_type(loss_type: str) -> None:
    """Skip (with the reason) when the installed TRL has no such loss type."""
    import trl

    from grpo_patches_testing import skip

    if loss_type not in installed_loss_types():
        skip(f"TRL {trl.__version__} has no loss_type={loss_type!r}")
