"""Whether the deferred prev-logprob pass needs NeMo-RL's inference bracket around it.

``grpo_train`` brackets its own pass: ``prepare_for_lp_inference()``, ``get_logprobs``, then
``prepare_for_training()``. The deferred pass (:mod:`.old_logprob_rows`) runs inside
``Policy.train``, right after ``grpo_train``'s own ``prepare_for_training()``; with the bracket
around it a step paid ``prepare_for_training`` twice. What the bracket does in the DTensor
workers (v1 and v2, v0.5.0 - main), and why the pass needs none of it:

* ``model.eval()``: the worker's ``get_logprobs`` sets it itself before its forwards, and its
  ``train()`` sets ``model.train()`` before its first one;
* the model (with ``cpu_offload``: its buffers) onto the device: ``prepare_for_training`` has
  just put it there;
* the optimizer state to the CPU, only with ``policy.offload_optimizer_for_logprob`` (memory
  for the pass), and back;
* ``gc.collect()`` and ``torch.cuda.empty_cache()``: memory only.

So the pass computes the same numbers without it. Measured on the benchmark's CPU workers
(benchmarks/RESULTS.md): ``prepare_for_lp_inference`` 0.85 s, ``prepare_for_training`` 0.42 s per
call, mostly the ``gc.collect()`` of a worker process holding torch and transformers. Kept where the
bracket frees memory the pass may need: ``offload_optimizer_for_logprob``, and the Megatron worker
(its bracket also moves the gradient buffers off the device).
"""

from __future__ import annotations

from typing import Any

from .calls import setting


def needed(config: Any) -> str | None:
    """Why the deferred pass keeps NeMo-RL's bracket (``None``: it runs without it)."""
    if setting(config, "policy.megatron_cfg.enabled", False):
        return "the Megatron policy worker (its bracket moves the gradient buffers off the device)"
    if setting(config, "policy.offload_optimizer_for_logprob", False):
        return "policy.offload_optimizer_for_logprob (the optimizer state leaves the device for the pass)"
    return None
