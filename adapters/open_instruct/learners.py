"""open-instruct's two learners seen the same way: their settings, models and accumulation rule.

:class:`Learner` reads a DeepSpeed learner (``grpo_fast.PolicyTrainerRayProcess``: ``args``,
``model`` the DeepSpeed engine, ``ref_policy``, ``num_mini_batches``) or an OLMo-core
``GRPOTrainModule`` (``grpo_config``, ``model``, ``ref_policy``, ``temperature``) through one
interface. The learners register themselves through two records: ``RayProcess.__init__`` (the
DeepSpeed learner's base class, which Ray pickles by reference) and ``GRPOTrainModule.train_batch``;
wrappers that only see a model find its learner with :func:`of_model`.

The two accumulation rules (open-instruct's own, modelled here and checked against the calls
that show them: ``resolve_old_logprob``'s ``num_mini_batches``, ``calculate_token_counts``'
``accumulation_steps``):

* DeepSpeed (``grpo_fast.py:602-608``): ``accumulation_steps = max(ceil(n / num_mini_batches - 0.5), 1)``,
  the last ``n % accumulation_steps`` micro-batches dropped, an optimizer step after every group;
* OLMo-core (``olmo_core_train_modules.py``, ``train_batch``): ``max(ceil(n / num_mini_batches), 1)``,
  nothing dropped, ``local_step`` counted across epochs (a last partial group steps after the loop).
"""

from __future__ import annotations

import math
from typing import Any, Callable

from . import FRAMEWORK
from .state import LEARNERS, LearnerState


class Learner:
    """One learner of either line (``line``: ``"deepspeed"`` or ``"olmo_core"``)."""

    __slots__ = ("owner", "line")

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.line = "olmo_core" if hasattr(owner, "grpo_config") else "deepspeed"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Learner) and other.owner is self.owner

    def __hash__(self) -> int:
        return id(self.owner)

    @property
    def state(self) -> LearnerState:
        return FRAMEWORK.state_of(self.owner, LearnerState)

    @property
    def args(self) -> Any:
        """open-instruct's ``GRPOExperimentConfig`` of this learner."""
        owner = self.owner
        return owner.grpo_config if self.line == "olmo_core" else getattr(owner, "args", None) or owner._args

    @property
    def policy(self) -> Any:
        return getattr(self.owner, "model", None)

    @property
    def reference(self) -> Any:
        return getattr(self.owner, "ref_policy", None)

    @property
    def temperature(self) -> float:
        owner = self.owner
        return float(owner.temperature if self.line == "olmo_core" else owner.streaming_config.temperature)

    @property
    def num_mini_batches(self) -> int:
        return int(self.args.num_mini_batches if self.line == "olmo_core" else self.owner.num_mini_batches)

    @property
    def dp_group(self) -> Any:
        """The data-parallel group its ranks decide over (``None``: the default group)."""
        if self.line == "olmo_core":
            trainer = getattr(self.owner, "_trainer", None) or getattr(self.owner, "trainer", None)
            return getattr(trainer, "dp_process_group", None)
        return None

    def accumulation(self, n: int) -> tuple[int, int]:
        """``(accumulation_steps, micro-batches trained)`` for a batch of ``n`` micro-batches."""
        nmb = self.num_mini_batches
        if self.line == "olmo_core":
            return max(math.ceil(n / nmb), 1), n
        steps = max(math.ceil(n / nmb - 0.5), 1)
        return steps, n - n % steps

    def optimizer_steps(self, n: int, accumulation_steps: int, epochs: int) -> int:
        """Optimizer steps one step of ``n`` micro-batches makes (verify mode's schedule)."""
        if self.line == "olmo_core":
            return math.ceil(epochs * n / accumulation_steps)
        return epochs * (n // accumulation_steps)

    def head_dtype(self, model: Any) -> Any:
        """The dtype of ``model``'s log-probs (its lm-head weight's)."""
        from .lm_heads import output_layer

        return output_layer(model).weight.dtype


def of_model(model: Any) -> tuple[Learner, str] | None:
    """The learner ``model`` belongs to and its role there (``"policy"`` or ``"reference"``)."""
    for owner in list(LEARNERS):
        learner = Learner(owner)
        if learner.policy is model:
            return learner, "policy"
        if learner.reference is not None and learner.reference is model:
            return learner, "reference"
    return None


def ray_process_init(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``RayProcess.__init__``: a DeepSpeed learner registers itself (other Ray processes are
    registered too; only one whose ``model`` a wrapper meets is ever used)."""
    result = wrapped(*args, **kwargs)
    LEARNERS.add(instance)
    return result


def train_batch(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``GRPOTrainModule.train_batch``: the OLMo-core learner registers itself; its optimizer steps are
    counted for verify mode's schedule."""
    LEARNERS.add(instance)
    return wrapped(*args, **kwargs)
