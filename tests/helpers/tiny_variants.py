"""Tiny causal LMs whose loss path differs from plain ``lm_head(hidden)``, saved with the word tokenizer.

- ``gemma2``: Gemma-2 with ``final_logit_softcapping`` (0.2: strongly non-linear at the tiny
  model's logit scale, so a missing softcap moves the weights);
- ``cohere2``: Cohere-2 with ``logit_scale`` 4.0;
- ``qwen2_moe``: Qwen2-MoE (4 experts, top 2) with ``output_router_logits`` and a router aux
  loss coefficient of 0.1 (TRL adds the aux loss to the loss);
- ``gpt_oss``: GPT-OSS (4 local experts, top 2, attention sinks, a sliding and a full layer), the
  family of TRL's ``test_train[tiny-GptOssForCausalLM]``.

Each is built once per process from a fixed seed (like :mod:`grpo_patches.demo.tiny_model`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from grpo_patches_testing import scratch

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=3,
              tie_word_embeddings=True)


def _config(kind: str, vocab: int) -> Any:
    import transformers

    if kind == "gemma2":
        return transformers.Gemma2Config(vocab_size=vocab, head_dim=16, final_logit_softcapping=0.2,
                                         attn_logit_softcapping=None, **COMMON)
    if kind == "cohere2":
        return transformers.Cohere2Config(vocab_size=vocab, logit_scale=4.0, layer_types=["sliding_attention",
                                          "full_attention"], **COMMON)
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeConfig(vocab_size=vocab, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                           output_router_logits=True, router_aux_loss_coef=0.1, **COMMON)
    if kind == "gpt_oss":
        return transformers.GptOssConfig(vocab_size=vocab, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                         sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                         **COMMON)
    raise ValueError(f"unknown tiny variant {kind!r}")


@functools.lru_cache(maxsize=None)
def model_path(kind: str) -> str:
    """Save the ``kind`` model and the tiny word tokenizer to a temp dir; return its path."""
    import torch
    import transformers

    from grpo_patches.demo import tiny_model

    tokenizer = tiny_model.build_tokenizer()
    config = _config(kind, len(tokenizer))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    path = Path(scratch.directory(f"tiny_{kind}_"))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
