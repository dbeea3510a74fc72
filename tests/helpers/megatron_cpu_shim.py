"""megatron-core on a CPU with gloo (tests only: nothing here ships, no megatron function is copied).

megatron-core places every buffer on ``torch.cuda.current_device()`` (or ``device="cuda"``),
forks a CUDA RNG state around tensor-parallel weight initialisation and dropout, and its
bridges build Transformer Engine layers. On a CPU machine:

* the kit's CUDA-to-CPU mode (:func:`grpo_patches_testing.cpu_torch.cuda_to_cpu_mode`) sends every ``"cuda"`` placement (``device=``,
  ``.to("cuda")``, ``.cuda()``) to the CPU; ``torch.cuda.current_device()`` answers 0, which
  the mode maps to the CPU as well (so ``GlobalMemoryBuffer.get_tensor`` allocates there);
* ``CudaRNGStatesTracker.fork`` is a no-op context and ``add`` remembers the name only (there is
  no CUDA generator; dropout is 0 in the tests, so no random stream is consumed);
* the bridges' layer spec is megatron-core's local one (``use_transformer_engine=False``):
  mbridge asks for Transformer Engine layers unconditionally (:func:`mbridge_local_layers`);
* no CUDA extension is built (:func:`no_cuda_extension_builds`): megatron-core 0.15 compiles a
  unified-memory allocator with ``load_inline(with_cuda=True)`` when ``megatron.core`` is imported.

Call :func:`install` before megatron-core builds anything. Everything set goes through one
:class:`grpo_patches_testing.cpu_torch.Rebinding` (:data:`SHIM`): :func:`uninstall` puts it back.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from grpo_patches_testing import cpu_torch

#: Everything this shim sets in the process (:func:`uninstall` puts it all back).
SHIM = cpu_torch.Rebinding()
_INSTALLED: list[bool] = []


class _Stream:
    """The one "stream" of a CPU: everything is already ordered (a class: libraries annotate with it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None


def install() -> None:
    """Install the shim once per process (idempotent; :func:`uninstall` undoes it)."""
    if _INSTALLED:
        return
    _INSTALLED.append(True)
    no_cuda_extension_builds()
    SHIM.enter(cpu_torch.cuda_to_cpu_mode())  # for the whole process: megatron allocates at import, build and step time
    cpu_torch.cuda_is_identity(SHIM, torch, tensor=False)  # the mode answers Tensor.cuda
    cpu_torch.answer_cuda_queries(SHIM, torch, (
        "current_device", "device_count", "synchronize", "empty_cache", "set_device", "get_device_name",
        "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved", "reset_peak_memory_stats",
        "manual_seed", "manual_seed_all"))
    stream = _Stream()
    SHIM.set(torch.cuda, "current_stream", lambda *a, **k: stream)
    SHIM.set(torch.cuda, "default_stream", lambda *a, **k: stream)
    SHIM.set(torch.cuda, "Stream", _Stream)
    SHIM.set(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())
    cpu_torch.nvtx_noops(SHIM, torch, always=True)  # CUDA wheels have NVTX; keep it from touching a driver
    _rng_tracker()


def uninstall() -> None:
    SHIM.undo()
    _INSTALLED.clear()


def no_cuda_extension_builds() -> None:
    """``load_inline(with_cuda=True)`` raises ``RuntimeError`` at once, as a failed build does.

    megatron-core 0.15 builds its unified-memory allocator when ``megatron.core`` is imported and
    catches ``RuntimeError``; with no GPU, torch fails before that (``IndexError`` from the empty CUDA
    arch list), or, with ``TORCH_CUDA_ARCH_LIST`` set, runs nvcc in every process to fail there.
    Needs to run before ``megatron.core`` is first imported (it binds ``load_inline`` at import)."""
    from torch.utils import cpp_extension

    original = cpp_extension.load_inline
    if getattr(original, "_grpo_patches_no_cuda", False):
        return

    def load_inline(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("with_cuda"):
            raise RuntimeError("no CUDA extension is built on a CPU machine (tests/helpers/megatron_cpu_shim.py)")
        return original(*args, **kwargs)

    load_inline._grpo_patches_no_cuda = True  # type: ignore[attr-defined]
    SHIM.set(cpp_extension, "load_inline", load_inline)


def _rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    tracker = mcore_random.CudaRNGStatesTracker

    @contextlib.contextmanager
    def fork(self: Any, name: str = "model-parallel-rng") -> Any:
        yield

    def add(self: Any, name: str, seed: int) -> None:
        self.states_[name] = None
        self.seeds_.add(seed)

    SHIM.set(tracker, "fork", fork)
    SHIM.set(tracker, "add", add)


def local_layer_spec(config: Any, vp_stage: int | None = None) -> Any:
    """megatron-core's local (no Transformer Engine) GPT block spec for ``config``."""
    import inspect

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    extra = {"vp_stage": vp_stage} if "vp_stage" in inspect.signature(get_gpt_decoder_block_spec).parameters else {}
    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, **extra)


def mbridge_model_type() -> None:
    """mbridge 0.15.1 compares with ``ModelType.encoder_and_decoder``, which megatron-core 0.19 removed
    (only ``encoder_or_decoder`` is left): its module gets a ``ModelType`` with both names (CPU and GPU)."""
    import types

    from mbridge.core import util as mbridge_util

    if not hasattr(mbridge_util.ModelType, "encoder_and_decoder"):
        SHIM.set(mbridge_util, "ModelType", types.SimpleNamespace(
            encoder_or_decoder=mbridge_util.ModelType.encoder_or_decoder, encoder_and_decoder=object()))


def mbridge_local_layers() -> None:
    """mbridge builds Transformer Engine layers unconditionally: build the local ones instead."""
    from mbridge.core.llm_bridge import LLMBridge

    mbridge_model_type()

    def _get_transformer_layer_spec(self: Any, vp_stage: int | None = None) -> Any:
        self.has_vp_stage = True
        return local_layer_spec(self.config, vp_stage)

    SHIM.set(LLMBridge, "_get_transformer_layer_spec", _get_transformer_layer_spec)
    _te_weight_names(LLMBridge)
    _causal_local_attention()


def _causal_local_attention() -> None:
    """The local ``DotProductAttention`` on the layouts verl hands it (Transformer Engine's conventions).

    * BSHD: verl passes a 2-D ``[batch, seq]`` padding mask; the local attention wants
      ``[batch, 1, seq, seq]``. Rows are right-padded and attention is causal, so a real token never
      sees padding: the local attention gets no mask and builds its causal one (padding positions'
      outputs are never read).
    * THD (packed sequences, the only layout of verl 0.6.1's legacy Megatron actor): the local
      attention refuses ``packed_seq_params``; it gets the packed tokens as one ``[tokens, 1, ...]``
      sequence and a block-diagonal causal mask over the (padded) sequence boundaries instead, so a
      token sees exactly its own sequence's earlier tokens, as Transformer Engine's varlen kernel does.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    original = DotProductAttention.forward
    if getattr(original, "_grpo_patches_causal", False):
        return

    def forward(self: Any, query: Any, key: Any, value: Any, attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
        packed = kwargs.get("packed_seq_params")
        if packed is not None and packed.qkv_format == "thd":
            kwargs["packed_seq_params"] = None
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))  # [t, heads, d] -> [t, 1, heads, d]
            attention_mask = _packed_causal_mask(packed, query.shape[0])
        elif attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = None
        return original(self, query, key, value, attention_mask, *args, **kwargs)

    forward._grpo_patches_causal = True  # type: ignore[attr-defined]
    SHIM.set(DotProductAttention, "forward", forward)


def _packed_causal_mask(packed: Any, tokens: int) -> torch.Tensor:
    """``[1, 1, tokens, tokens]``, True where attention is masked: another sequence, or a later token."""
    bounds = packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None else packed.cu_seqlens_q
    position = torch.arange(tokens)
    sequence = torch.bucketize(position, bounds[1:].to(torch.long).cpu(), right=True)  # each token's sequence
    masked = (sequence[:, None] != sequence[None, :]) | (position[None, :] > position[:, None])
    return masked[None, None]


#: The local spec's norm weights and the Transformer Engine names (norm fused into the next linear)
#: that mbridge's weight maps know.
_LOCAL_TO_TE = ((".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"),
                (".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight"))


def _te_name(name: str) -> str:
    for local, te in _LOCAL_TO_TE:
        if name.endswith(local):
            return name[: -len(local)] + te
    return name


def _te_weight_names(bridge_class: type) -> None:
    """mbridge's methods that read a megatron weight name see the Transformer Engine name."""
    import functools

    for method in ("_weight_name_mapping_mcore_to_hf", "_weight_to_mcore_format", "_weight_to_hf_format",
                   "_weight_merge_across_tp", "_weight_split_across_tp"):
        original = getattr(bridge_class, method, None)
        if original is None or getattr(original, "_grpo_patches_te_names", False):
            continue

        @functools.wraps(original)
        def renamed(self: Any, name: str, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            return _original(self, _te_name(name), *args, **kwargs)

        renamed._grpo_patches_te_names = True  # type: ignore[attr-defined]
        SHIM.set(bridge_class, method, renamed)
