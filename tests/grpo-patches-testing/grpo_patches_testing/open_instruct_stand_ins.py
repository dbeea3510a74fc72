"""What ``from_pretrained`` and ``step()`` of open-instruct's learner lack on a CPU, and the
test-only stand-ins (no open-instruct function body is changed; :func:`cpu_setup` undoes each on exit):

* ``vllm`` cannot be installed beside torch 2.13: :mod:`.open_instruct_vllm` answers its imports
  while open-instruct's modules are imported (the learner never calls it).
* ``from_pretrained`` is written for one GPU per actor: ``torch.cuda.set_device`` is a no-op, a
  torch function mode sends its ``"cuda"`` placements to the CPU (``MetricsTracker`` on
  ``torch.device(local_rank)``), the model loads without ``device_map``; afterwards the learner's
  ``device`` is the CPU. DeepSpeed runs its CPU accelerator (``DS_ACCELERATOR=cpu``, gloo; a gloo
  group exists before ``from_pretrained``, so its ``nccl`` init is skipped, as upstream intends).
* fp32 (``Config.bf16=False``): ``get_train_ds_config`` / ``get_eval_ds_config`` are called with
  ``bf16=False`` and the model loads in fp32 (upstream hard-codes bf16; ``Config.float64``: in
  float64). ZeRO-3's persistence threshold is scaled to the tiny model
  (``Config.stage3_param_persistence_threshold``).
  ``optimizer="sgd"``: ``torch.optim.AdamW`` built by ``from_pretrained`` becomes SGD (exact
  per-step comparisons; AdamW turns rounding noise into different trajectories), with
  ``zero_allow_untested_optimizer``.
* ZeRO-3 on gloo ranks: loading the partitioned model on DeepSpeed's CPU accelerator can leave a weight
  holding stale memory; every ZeRO-3 model is checked against the checkpoint (and what differs written
  again) before ``deepspeed.initialize`` (:mod:`.open_instruct_zero3_start`).
* The data: ``streaming_config.build_dataloader`` (it reaches a Ray actor) returns the batches
  (:func:`streaming_config`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from grpo_patches_testing import cpu_torch

if TYPE_CHECKING:  # pragma: no cover
    from grpo_patches_testing.open_instruct_cpu import Config


def _streaming_class() -> type:
    from open_instruct.data_loader import StreamingDataLoaderConfig

    class Streaming(StreamingDataLoaderConfig):
        """open-instruct's config whose data loader hands out the prepared batches (the real one
        asks the ``DataPreparationActor`` Ray actor for them)."""

        batches: list[dict] = ()  # type: ignore[assignment]  # set after construction; not a field

        def build_dataloader(self, **kwargs: Any) -> Any:
            return _Batches(list(self.batches))

    return Streaming


class _Batches:
    def __init__(self, items: list[dict]) -> None:
        self.items = items

    def __iter__(self) -> Iterator[dict]:
        return iter(self.items)

    def state_dict(self) -> dict:
        return {}


def streaming_config(**kwargs: Any) -> Any:
    """open-instruct's ``StreamingDataLoaderConfig`` whose data loader hands out the batches set on
    it as ``.batches`` (its class is made on first use: open-instruct is imported late)."""
    return _streaming_class()(**kwargs)


def cpu_stand_ins(config: Config, ds_owner: Any) -> list[tuple[Any, str, Any]]:
    """What ``from_pretrained`` needs on a CPU (module docstring), as ``(owner, attribute, stand-in)``.

    ``ds_owner`` is where the learner looks up open-instruct's DeepSpeed config builders: ``grpo_fast``
    in-process; ``open_instruct.utils`` in the end-to-end run, where Ray ships the learner class by value
    and its globals take the builders from that module by name (each stand-in keeps the builder's name
    for that)."""
    import functools

    import torch
    import transformers

    auto = transformers.AutoModelForCausalLM
    real_load = auto.from_pretrained.__func__

    def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("device_map", None)
        if not config.bf16:
            kwargs["dtype"] = torch.float64 if config.float64 else torch.float32
        return real_load(cls, *args, **kwargs)

    def ds_config(real: Any) -> Any:
        @functools.wraps(real)
        def make(*args: Any, **kwargs: Any) -> Any:
            kwargs["bf16"] = config.bf16
            out = real(*args, **kwargs)
            cfg = out[0] if isinstance(out, tuple) else out  # get_eval_ds_config: (config, HfDeepSpeedConfig)
            cfg["zero_allow_untested_optimizer"] = True
            threshold = config.stage3_param_persistence_threshold
            if threshold is not None:
                cfg["zero_optimization"]["stage3_param_persistence_threshold"] = threshold
            return out

        return make

    out = [(torch.cuda, "set_device", lambda *a, **k: None), (auto, "from_pretrained", classmethod(from_pretrained)),
           (ds_owner, "get_train_ds_config", ds_config(ds_owner.get_train_ds_config)),
           (ds_owner, "get_eval_ds_config", ds_config(ds_owner.get_eval_ds_config))]
    if config.optimizer == "sgd":
        out.append((torch.optim, "AdamW", lambda params, lr, **_: torch.optim.SGD(params, lr=lr)))
    return out


@contextlib.contextmanager
def cpu_setup(grpo_fast: Any, config: Config, checkpoint: str | None = None) -> Iterator[None]:
    """The stand-ins ``from_pretrained`` needs on a CPU (module docstring); all undone on exit. With
    ``checkpoint``, a ZeRO-3 policy must hold it when DeepSpeed gets it (:mod:`.open_instruct_zero3_start`)."""
    shim = cpu_torch.Rebinding()
    for owner, name, value in cpu_stand_ins(config, grpo_fast):
        shim.set(owner, name, value)
    if checkpoint is not None and config.deepspeed_stage == 3:
        import deepspeed

        from grpo_patches_testing.open_instruct_zero3_start import checked_initialize

        shim.set(deepspeed, "initialize", checked_initialize(deepspeed.initialize, checkpoint))
    with shim:
        shim.enter(cpu_torch.cuda_to_cpu_mode())
        yield

