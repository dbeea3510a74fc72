"""open-instruct's OLMo-core learner on a CPU, in-process: the real ``GRPOTrainModule.train_batch``.

``open_instruct/grpo.py`` trains through ``grpo_olmo_core_actor.PolicyTrainerOLMoCoreProcess``, which
builds ``olmo_core_train_modules.GRPOTrainModule`` (an OLMo-core ``TransformerTrainModule``) and lets
OLMo-core's ``Trainer`` call its ``train_batch`` once per step. :func:`train` builds that train module
on a tiny OLMo-core transformer (``TransformerConfig.llama_like``, from a seed; the actor's
``setup_model`` only knows full-size OLMo / Qwen3 configs) and calls the unmodified ``train_batch`` on
the batches of :func:`grpo_patches_testing.open_instruct_cpu.batches` (open-instruct's own packing and
collation), one process, no data parallelism.

What a CPU lacks, and the test-only stand-ins (undone when :func:`train` returns):

* ``train_batch`` always asks for intra-document masking (``doc_lens`` from the packed attention
  mask), which only OLMo-core's flash / TE backends implement, and on a machine without CUDA OLMo-core
  builds its torch backend whatever was asked (``olmo_core/nn/attention/__init__.py``), which refuses
  it. :func:`doc_masked_attention` gives the torch backend what flash-attn's varlen kernel computes:
  causal attention within each document of ``cu_doc_lens`` (tested against documents run one by one).
* The ``Trainer``: ``train_batch`` reads ``dp_process_group``, ``global_step``, ``max_steps``,
  ``steps_per_epoch`` and records metrics through it; a small stand-in holds those.

Recorded (:class:`~grpo_patches_testing.open_instruct_cpu.Result`): the gradient and its norm before
each optimizer step (a plain module: gradients are whole), the final weights, reference forwards,
no-grad and grad-enabled policy forwards, lm-head outputs of ``[B, T, vocab]``, the metrics.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

from grpo_patches_testing import open_instruct_cpu as deepspeed_learner
from grpo_patches_testing.open_instruct_cpu import Config, Result

#: The tiny transformer: the shared tokenizer's vocabulary, 2 layers of width 64 (as the HF tiny Qwen2).
TINY = dict(d_model=64, n_layers=2, n_heads=4)


def load() -> Any:
    """open-instruct's ``olmo_core_train_modules`` (imported under the vLLM stand-in); skips without it."""
    deepspeed_learner.load()
    from grpo_patches_testing import open_instruct_vllm

    with open_instruct_vllm.installed():
        from open_instruct import olmo_core_train_modules  # noqa: PLC0415
    return olmo_core_train_modules


def tiny_transformer(vocab_size: int, seed: int = 0) -> Any:
    import torch
    from olmo_core.nn.attention import AttentionBackendName
    from olmo_core.nn.transformer import TransformerConfig

    config = TransformerConfig.llama_like(vocab_size=vocab_size, attn_backend=AttentionBackendName.flash_2, **TINY)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return config.build(init_device="cpu")


@contextlib.contextmanager
def doc_masked_attention() -> Iterator[None]:
    """OLMo-core's torch attention backend with intra-document masking (``cu_doc_lens`` over the
    flattened ``B * T`` tokens, as flash-attn's varlen kernel takes it); undone on exit."""
    import torch
    import torch.nn.functional as F
    from olmo_core.nn.attention.backend import TorchAttentionBackend

    real = TorchAttentionBackend.forward

    def forward(self: Any, qkv: Any, cu_doc_lens: Any = None, cu_doc_lens_q: Any = None, cu_doc_lens_k: Any = None,
                max_doc_len: Any = None, max_doc_len_q: Any = None, max_doc_len_k: Any = None, **kwargs: Any) -> Any:
        if cu_doc_lens is None:
            return real(self, qkv, cu_doc_lens_q=cu_doc_lens_q, cu_doc_lens_k=cu_doc_lens_k, max_doc_len=max_doc_len,
                        max_doc_len_q=max_doc_len_q, max_doc_len_k=max_doc_len_k, **kwargs)
        q, k, v = qkv
        batch, length, heads, dim = q.shape
        position = torch.arange(batch * length, device=q.device)
        document = torch.bucketize(position, cu_doc_lens[1:].to(q.device), right=True)
        allowed = (document[:, None] == document[None, :]) & (position[None, :] <= position[:, None])

        def flat(t: Any) -> Any:  # (B, T, h, D) -> (1, heads, B * T, D), key / value heads repeated (GQA)
            t = t.reshape(1, batch * length, t.shape[2], dim)
            return t.repeat_interleave(heads // t.shape[2], dim=2).transpose(1, 2)

        out = F.scaled_dot_product_attention(flat(q), flat(k), flat(v), attn_mask=allowed, scale=self.scale)
        return out.transpose(1, 2).reshape(batch, length, heads, dim)

    TorchAttentionBackend.forward = forward
    try:
        yield
    finally:
        TorchAttentionBackend.forward = real


def train(config: Config) -> Result:
    """``config.steps`` calls of the real ``GRPOTrainModule.train_batch`` (one rank; ``deepspeed_stage``,
    ``optimizer`` and ``bf16`` do not apply: OLMo-core's AdamW at ``learning_rate``, fp32)."""
    import copy

    import torch
    from olmo_core.nn.attention import AttentionBackendName
    from olmo_core.optim import AdamWConfig
    from open_instruct import data_loader, grpo_utils

    modules = load()
    from grpo_patches.demo import tiny_model

    assert config.world_size == 1, "the OLMo-core harness runs one rank"
    deepspeed_learner.init_gloo()
    path = deepspeed_learner.model_path()
    tokenizer = tiny_model.load_tokenizer(path)
    steps = [per_rank[0] for per_rank in deepspeed_learner.batches(config, path, 1)]
    streaming = data_loader.StreamingDataLoaderConfig(
        pack_length=config.pack_length, max_prompt_token_length=config.pack_length // 2,
        response_length=config.pack_length // 2, temperature=config.temperature,
        num_samples_per_prompt_rollout=config.samples_per_prompt, num_unique_prompts_rollout=config.prompts,
        filter_zero_std_samples=config.filter_zero_std_samples)
    vocab = len(tokenizer)
    result = Result(micro_batches=[len(s["batch"]) for s in steps], micro_batch_shapes=deepspeed_learner.shapes(steps))
    with doc_masked_attention(), deepspeed_learner._enabled(config.enable):  # before the config is made
        args = grpo_utils.GRPOExperimentConfig(
            world_size=1, num_training_steps=config.steps, num_mini_batches=config.num_mini_batches,
            num_epochs=config.num_epochs, beta=config.beta, load_ref_policy=config.load_ref_policy,
            loss_fn=config.loss_fn, kl_estimator=config.kl_estimator, loss_denominator=config.loss_denominator,
            learning_rate=config.learning_rate, max_grad_norm=1e9, **dict(config.args))  # 1e9: the norm, no clipping
        model = tiny_transformer(vocab, config.seed)
        initial = copy.deepcopy(model.state_dict())
        # grpo_olmo_core_actor.py: a reference model only when load_ref_policy and beta > 0
        ref = None
        if args.load_ref_policy and args.beta > 0:
            ref = tiny_transformer(vocab, config.seed)
        module = modules.GRPOTrainModule(
            model=model, optim=AdamWConfig(lr=config.learning_rate), sample_microbatch_size=config.per_device_train_batch_size,
            max_sequence_length=config.pack_length, grpo_config=args, temperature=config.temperature,
            tokenizer=tokenizer, streaming_config=streaming, attn_implementation=AttentionBackendName.flash_2,
            ref_policy=ref, compile_model=False, device=torch.device("cpu"))
        module.model.load_state_dict(initial)  # the actor reloads the checkpoint after the module's init
        if ref is not None:
            ref.load_state_dict(initial)
        trainer = types.SimpleNamespace(dp_process_group=None, global_step=0, max_steps=config.steps,
                                        steps_per_epoch=config.steps, record_metric=_recorder(result))
        module._trainer = trainer
        with _recording(module, ref, vocab, result):
            for step, batch in enumerate(steps, start=1):
                trainer.global_step = step
                result.metrics.append({})
                module.train_batch(batch)
        result.ref_model_built = ref is not None
        result.weights = {n: p.detach().clone() for n, p in module.model.named_parameters()}
        result.status = deepspeed_learner.adapter_status(config)
    return result


def _recorder(result: Result) -> Any:
    def record_metric(name: str, value: Any, **_: Any) -> None:
        result.metrics[-1][name] = float(value)

    return record_metric


@contextlib.contextmanager
def _recording(module: Any, ref: Any, vocab: int, result: Result) -> Iterator[None]:
    import torch

    heads = [module.model.lm_head] + ([ref.lm_head] if ref is not None else [])
    handles = deepspeed_learner.count_forwards(module.model, ref, heads, vocab, result)
    real_step = module._do_optim_step

    def do_optim_step() -> None:
        grads = {n: p.grad.detach().clone() for n, p in module.model.named_parameters() if p.grad is not None}
        result.gradients.append(grads)
        result.grad_norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))))
        real_step()

    module._do_optim_step = do_optim_step
    try:
        yield
    finally:
        del module._do_optim_step
        for handle in handles:
            handle.remove()
