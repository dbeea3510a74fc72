"""The test kit (distribution ``grpo-patches-testing``, not part of the product's wheel): running
the frameworks' own code on a CPU with a tiny model, patched and unpatched; what the end-to-end
tests and the benchmarks share (grpo_patches never imports it).

* verl: :mod:`.verl_cpu_shim` (a CPU platform for verl's engine line), :mod:`.verl_main_ppo`
  (``python -m verl.trainer.main_ppo`` on a Ray cluster of its own, with the stand-in rollout of
  :mod:`.verl_main_ppo_rollout` loaded in every process by :mod:`.verl_main_ppo_plugin`);
* NeMo-RL (from a source checkout): :mod:`.nemo_rl_cpu` (its real worker in one process),
  :mod:`.nemo_rl_run_grpo` (``examples/run_grpo.py`` on a Ray cluster of its own, with the CPU
  start-up hook in ``nemo_rl_startup/``), :mod:`.nemo_rl_tags` (configs and classes per tag);
* TRL: :mod:`.trl_train` (``GRPOTrainer`` on the demo's tiny model).
* open-instruct (from a source checkout): :mod:`.open_instruct_cpu` (the real DeepSpeed learner's
  ``PolicyTrainerRayProcess.step()`` in-process, one or two gloo ranks; its CPU stand-ins, records,
  ranks and DeepSpeed op in ``open_instruct_stand_ins``, ``open_instruct_records``,
  ``open_instruct_ranks``, ``open_instruct_deepspeed_op``), :mod:`.open_instruct_olmo_core`
  (its OLMo-core learner's ``GRPOTrainModule.train_batch``), :mod:`.open_instruct_batches` (rollouts
  packed and collated by its own code), :mod:`.open_instruct_vllm` (the ``vllm`` import stand-in) and
  ``open_instruct_startup/`` (the start-up hook of its end-to-end runs).

None of it patches a framework function: each piece uses the framework's own extension points
or stands in for hardware a CPU lacks. Nothing here is needed to use grpo_patches.
"""

from __future__ import annotations

from typing import NoReturn

__version__ = "0.1.0"


class Unavailable(RuntimeError):
    """What a runner needs is not installed (outside pytest; under pytest it skips)."""


def skip(reason: str) -> NoReturn:
    """Skip the calling test (module level included) under pytest; raise :class:`Unavailable` elsewhere."""
    import sys

    pytest = sys.modules.get("pytest")
    if pytest is not None:
        pytest.skip(reason, allow_module_level=True)
    raise Unavailable(reason)
