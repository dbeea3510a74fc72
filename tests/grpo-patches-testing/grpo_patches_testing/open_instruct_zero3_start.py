"""ZeRO-3 on gloo ranks: the models DeepSpeed is handed must hold the checkpoint (test-only stand-in).

Measured 2026-11-29 (open-instruct main, DeepSpeed 0.18.4 on its CPU accelerator, torch 2.13 gloo, two
spawned ranks, the tiny Qwen2 at a persistence threshold of 1000): loading the partitioned model
(transformers' ``_load_state_dict_into_zero3_model``: one ``GatheredParameters(modifier_rank=0)`` per
module) now and then leaves one weight of the q/k/v projections (the modules with a weight *and* a bias,
gathered together) holding what was in memory -- values up to 4.9e14, NaN, a different tensor each time
(6 of 10 loads in two pairs of processes; the fp32 copy DeepSpeed's optimizer starts from, read right after
``deepspeed.initialize``). That, not a reduction order (two ranks sum two numbers: commutative), is why
unpatched ZeRO-3 on two ranks did not reproduce itself: grad norms 11.6, 93.2, 1.4e-4, 73.1 from a clean
load, 1.6e7 then 0 from a corrupted one. DeepSpeed's CPU accelerator declares itself a synchronized
device (``resolves_data_dependency``), so ZeRO-3 skips the stream synchronisations that follow its
asynchronous gathers on a GPU, while gloo runs them on its own threads. Only modules with two parameters
(a weight and a bias: gathered together, ``_allgather_params_coalesced``, which waits on its last handle
only) were hit; a late gather landing after rank 0 copied the checkpoint in would explain it (not proven:
waiting on every handle of DeepSpeed's collectives, tried once, still saw one corrupted load).

The stand-in (:func:`checked_initialize`): before ``deepspeed.initialize`` of a ZeRO-3 model, gather each
parameter alone (a synchronous gather) and compare it with the checkpoint; a tensor that differs is written
again from the checkpoint on rank 0 and broadcast (``GatheredParameters(modifier_rank=0)``, again one
parameter at a time), then checked once more; what is still wrong is an error naming the tensor. Every
rank sees the same gathered values, so every rank decides the same. It makes the model DeepSpeed trains
the one open-instruct loaded on a GPU; nothing of open-instruct or DeepSpeed is changed, and GPUs (NCCL,
one stream) are not concerned.
"""

from __future__ import annotations

import functools
import glob
import sys
from typing import Any, Callable


def checked_initialize(initialize: Callable[..., Any], checkpoint: str) -> Callable[..., Any]:
    """``deepspeed.initialize`` that first makes sure, on a ZeRO-3 model (the policy, and the reference
    model: both loaded from the checkpoint), that every parameter holds the checkpoint's values (cast to the
    parameter's dtype)."""

    @functools.wraps(initialize)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        model = kwargs.get("model")
        if model is not None:
            restore_checkpoint(model, checkpoint)
        return initialize(*args, **kwargs)

    return wrapper


def restore_checkpoint(model: Any, checkpoint: str) -> list[str]:
    """The parameters of the partitioned ``model`` that did not hold ``checkpoint``'s values, written again
    (module docstring); raises if one still differs."""
    params = dict(model.named_parameters())
    if not any(hasattr(p, "ds_id") for p in params.values()):  # not partitioned: nothing gathered, nothing raced
        return []
    saved = _saved(model, checkpoint, params)
    wrong = [name for name in saved if _differs(params[name], saved[name])]
    if wrong:
        import deepspeed
        import torch.distributed as dist

        for name in wrong:
            with deepspeed.zero.GatheredParameters([params[name]], modifier_rank=0):
                if dist.get_rank() == 0:
                    params[name].data.copy_(saved[name].reshape(params[name].shape).to(params[name].dtype))
        print(f"open_instruct_zero3_start: ZeRO-3 loading left {', '.join(wrong)} not the checkpoint's: written "
              "again", file=sys.stderr, flush=True)
        still = [name for name in wrong if _differs(params[name], saved[name])]
        if still:
            raise RuntimeError("ZeRO-3 loaded a model that is not the checkpoint, and writing it again failed "
                               f"(grpo_patches_testing/open_instruct_zero3_start.py): {', '.join(still)}")
    return wrong


def _saved(model: Any, checkpoint: str, params: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's tensor for each parameter (a tied lm-head: the embedding's)."""
    from safetensors.torch import load_file

    saved: dict[str, Any] = {}
    for path in sorted(glob.glob(f"{checkpoint}/*.safetensors")):
        saved.update(load_file(path))
    out = {}
    for name in params:
        reference = saved.get(name)
        if reference is None and name.endswith("lm_head.weight") and getattr(model.config, "tie_word_embeddings", False):
            reference = saved.get(name.replace("lm_head", "model.embed_tokens"))
        if reference is not None:
            out[name] = reference
    return out


def _differs(param: Any, reference: Any) -> bool:
    """One synchronous gather of ``param`` alone (a collective: every rank, the same order)."""
    import deepspeed
    import torch

    with deepspeed.zero.GatheredParameters([param]):
        value = param.detach().clone()
    return not torch.equal(value.reshape(reference.shape), reference.to(value.dtype))
