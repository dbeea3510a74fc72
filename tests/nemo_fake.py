"""A test-only stand-in for NeMo-RL, one per tag line, written into a temporary directory.

It mirrors the real source where the adapter touches it — module paths, class and function
names, call signatures, the order of calls in ``grpo_train`` and in the DTensor worker's
``train()`` — and nothing else (no Ray, no vLLM, no Automodel): a ``Policy`` runs its one
in-process worker. The loss is a compact clipped policy-gradient loss with NeMo-RL's
normalisation (global token / sequence counts) and metric names. Per tag:

* v0.5.0: ``nemo_rl.algorithms.loss_functions``, ``loss_fn(next_token_logits, data, gvs, gvt)``
  with a dict config; the worker class is the ``@ray.remote`` class itself and its ``train``
  takes micro-batches from ``BatchedDataDict.make_microbatch_iterator``; both passes always run.
* v0.6.0: ``nemo_rl.algorithms.loss``, ``prepare_loss_input`` then
  ``loss_fn(next_token_logprobs=..., ...)``; ``DTensorPolicyWorkerV2Impl`` with
  ``get_microbatch_iterator`` imported by name; ``skip_reference_policy_logprobs_calculation``;
  ``compute_and_apply_seq_logprob_error_masking`` returns a tuple.
* v0.7.0: a config object; ``opd._skip_prev_logprobs``; zero placeholders for the
  sequence-level metrics; no reference model at KL 0.
* main: like v0.7.0, ``package_info`` still says 0.6.0, ``use_fused_linear_logprobs``,
  ``_resolve_logprob_skip_flags`` and ``_placeholder_seq_logprob_error_metrics``.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

TAGS = ("v0.5.0", "v0.6.0", "v0.7.0", "main")
VERSIONS = {"v0.5.0": (0, 5, 0, "rc0"), "v0.6.0": (0, 6, 0, ""), "v0.7.0": (0, 7, 0, ""), "main": (0, 6, 0, "")}
READS_AS = {"v0.5.0": "0.5.0rc0", "v0.6.0": "0.6.0", "v0.7.0": "0.7.0", "main": "0.8.0.dev0"}

PACKAGE_INFO = """
MAJOR = {0}
MINOR = {1}
PATCH = {2}
PRE_RELEASE = "{3}"
"""

BATCHED_DATA_DICT = '''
from collections import UserDict

import torch


class BatchedDataDict(UserDict):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.micro_batch_indices = None
        self.micro_batch_lengths = None

    @property
    def size(self):
        return next(iter(self.data.values())).shape[0]

    def select_indices(self, indices):
        return type(self)({k: v[indices] for k, v in self.data.items()})

    def slice(self, start, end):
        return type(self)({k: v[start:end] for k, v in self.data.items()})

    def truncate_tensors(self, dim, truncated_len):
        for k, v in self.items():
            if torch.is_tensor(v) and v.dim() >= dim + 1:
                self.data[k] = torch.narrow(v, dim, 0, truncated_len)

    def get_batch(self, batch_idx, batch_size):
        batch = self.slice(batch_idx * batch_size, (batch_idx + 1) * batch_size)
        if self.micro_batch_indices is not None:
            batch.micro_batch_indices = [self.micro_batch_indices[batch_idx]]
            batch.micro_batch_lengths = [self.micro_batch_lengths[batch_idx]]
        return batch

    def make_microbatch_iterator(self, microbatch_size):
        assert self.size % microbatch_size == 0
        for i in range(0, self.size, microbatch_size):
            yield self.slice(i, i + microbatch_size)

    def make_microbatch_iterator_with_dynamic_shapes(self, sequence_dim=1):
        for seqlen, (start, end) in zip(self.micro_batch_lengths[0], self.micro_batch_indices[0]):
            mb = self.slice(start, end)
            mb.truncate_tensors(dim=sequence_dim, truncated_len=seqlen)
            yield mb

    def get_microbatch_iterator_dynamic_shapes_len(self):
        return len(self.micro_batch_indices[0])

    def to(self, device):
        return self
'''

# The loss: NeMo-RL's formulas, written compactly (masked_mean divides by count + 1e-8).
LOSS = '''
import enum

import torch

from {tag_module} import TAG


class LossType(enum.Enum):
    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


def masked_mean(values, mask, dim=None, global_normalization_factor=None):
    total = (values * mask).sum() if dim is None else (values * mask).sum(dim)
    count = global_normalization_factor if global_normalization_factor is not None else (
        mask.sum() if dim is None else mask.sum(dim))
    return total / (count + 1e-8)


def _get(cfg, key, default=None):
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


class ClippedPGLossFn:
    def __init__(self, cfg{fused_arg}):
        self.ratio_clip_min = _get(cfg, "ratio_clip_min", 0.2)
        self.ratio_clip_max = _get(cfg, "ratio_clip_max", 0.2)
        self.ratio_clip_c = _get(cfg, "ratio_clip_c")
        kl = _get(cfg, "reference_policy_kl_penalty", 0.0)
        self.reference_policy_kl_penalty = 0 if _get(cfg, "use_kl_in_reward", False) and TAG in ("v0.7.0", "main") else kl
        self.disable_ppo_ratio = _get(cfg, "disable_ppo_ratio", False)
        self.force_on_policy_ratio = _get(cfg, "force_on_policy_ratio", False)
        self.use_importance_sampling_correction = _get(cfg, "use_importance_sampling_correction", False)
        self.sequence_level_importance_ratios = _get(cfg, "sequence_level_importance_ratios", False)
        self.truncated_importance_sampling_type = _get(cfg, "truncated_importance_sampling_type")
        self.positive_example_nll_weight = _get(cfg, "positive_example_nll_weight", 0.0)
        self.use_cispo = _get(cfg, "use_cispo", False)
        self.loss_type = LossType.TOKEN_LEVEL if _get(cfg, "token_level_loss", True) else LossType.SEQUENCE_LEVEL
        {fused_body}

    def _loss(self, curr, data, global_valid_seqs, global_valid_toks):
        token_mask = data["token_mask"][:, 1:]
        sample_mask = data["sample_mask"]
        advantages = data["advantages"][:, 1:]
        generation = data["generation_logprobs"][:, 1:]
        reads_prev = TAG in ("v0.5.0", "v0.6.0") or not self.force_on_policy_ratio
        prev = data["prev_logprobs"][:, 1:] if reads_prev else None
        if self.force_on_policy_ratio and not reads_prev:
            prev = curr.detach()
        mask = token_mask * sample_mask.unsqueeze(-1)
        mult_prob_error = masked_mean(torch.exp(torch.abs(generation - prev) * mask), mask,
                                      global_normalization_factor=global_valid_toks).item()
        gen_kl = masked_mean(torch.exp(prev - generation) - (prev - generation) - 1, mask,
                             global_normalization_factor=global_valid_toks).item()
        kl = torch.tensor(0.0)
        if self.reference_policy_kl_penalty != 0:
            ref = data["reference_policy_logprobs"][:, 1:]
            kl = self.reference_policy_kl_penalty * masked_mean(
                torch.exp(ref - curr) - (ref - curr) - 1, mask, global_normalization_factor=global_valid_toks)
        if self.force_on_policy_ratio:
            ratios = (curr - curr.detach()).exp()
            clamped = ratios
        else:
            ratios = (curr - prev).exp()
            clamped = ratios.clamp(1 - self.ratio_clip_min, 1 + self.ratio_clip_max)
        clip_loss = torch.max(-advantages * ratios, -advantages * clamped)
        if self.ratio_clip_c is not None:
            clip_loss = torch.where(advantages < 0, torch.min(clip_loss, -advantages * self.ratio_clip_c), clip_loss)
        weights = torch.exp(prev - generation) if self.use_importance_sampling_correction else torch.ones_like(curr)
        if self.loss_type == LossType.TOKEN_LEVEL:
            actor = masked_mean(weights * clip_loss, mask, global_normalization_factor=global_valid_toks)
        else:
            actor = masked_mean(masked_mean(weights * clip_loss, token_mask, dim=-1), sample_mask,
                                global_normalization_factor=global_valid_seqs)
        loss = actor + kl
        with torch.no_grad():
            picked = ratios.detach()[mask.bool()]
            metrics = {{
                "loss": loss.item(),
                "probs_ratio": masked_mean(ratios.detach(), mask, global_normalization_factor=global_valid_toks).item(),
                "probs_ratio_min": picked.min().item() if picked.numel() else float("inf"),
                "probs_ratio_max": picked.max().item() if picked.numel() else float("-inf"),
                "kl_penalty": kl.item() / self.reference_policy_kl_penalty if self.reference_policy_kl_penalty else 0,
                "token_mult_prob_error": mult_prob_error,
                "gen_kl_error": gen_kl,
                "sampling_importance_ratio": masked_mean(torch.exp(prev - generation), mask,
                                                         global_normalization_factor=global_valid_toks).item(),
                "num_valid_samples": sample_mask.sum().item(),
                "approx_entropy": -masked_mean(torch.exp(curr - generation) * curr, mask,
                                               global_normalization_factor=global_valid_toks).item(),
            }}
        return loss, metrics

{call}
'''

CALL_V05 = '''
    def __call__(self, next_token_logits, data, global_valid_seqs, global_valid_toks, vocab_parallel_rank=None,
                 vocab_parallel_group=None, context_parallel_group=None):
        logprobs = torch.log_softmax(next_token_logits.float()[:, :-1], dim=-1)
        curr = logprobs.gather(-1, data["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
        return self._loss(curr, data, global_valid_seqs, global_valid_toks)
'''

CALL_V06 = '''
    def __call__(self, next_token_logprobs, data, global_valid_seqs, global_valid_toks):
        return self._loss(next_token_logprobs, data, global_valid_seqs, global_valid_toks)
'''

LOSS_PACKAGE_INIT = '''
from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossFn, LossType  # noqa: F401
from nemo_rl.algorithms.loss.utils import prepare_loss_input  # noqa: F401
'''

LOSS_UTILS = '''
import torch


def prepare_loss_input(logits, data, loss_fn, sampling_params=None):
    logprobs = torch.log_softmax(logits.float()[:, :-1], dim=-1)
    curr = logprobs.gather(-1, data["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    return {"next_token_logprobs": curr}, data
'''

MODEL = '''
import types

import torch


class TinyLM(torch.nn.Module):
    """A causal LM's shape: ``model`` (the backbone) then ``lm_head``, called inside forward."""

    def __init__(self, vocab=23, hidden=8, seed=0, tied=False):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight
        self.config = types.SimpleNamespace()
        self.forwards = 0
        self.rows = 0

    def forward(self, input_ids, **kwargs):
        self.forwards += 1
        self.rows += int(input_ids.shape[0])
        hidden = torch.tanh(self.mix(self.embed(input_ids)))
        hidden = hidden + torch.cumsum(hidden, dim=1) / 4  # causal mixing over positions
        return types.SimpleNamespace(logits=self.lm_head(hidden))
'''

# v0.6.0+ ``nemo_rl.models.automodel.data``
AUTOMODEL_DATA = '''
import itertools
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ProcessedMicrobatch:
    data_dict: Any
    processed_inputs: Any
    original_batch_size: int
    original_seq_len: int


def make_processed_microbatch_iterator(raw_iterator, tokenizer, cfg, cp_size):
    for data_dict in raw_iterator:
        yield ProcessedMicrobatch(data_dict, {"input_ids": data_dict["input_ids"]}, data_dict["input_ids"].shape[0],
                                  data_dict["input_ids"].shape[1])


def get_microbatch_iterator(data, cfg, mbs, dp_mesh, tokenizer, cp_size=1):
    if cfg["dynamic_batching"]["enabled"]:
        iterator, length = data.make_microbatch_iterator_with_dynamic_shapes(), data.get_microbatch_iterator_dynamic_shapes_len()
    else:
        iterator, length = data.make_microbatch_iterator(mbs), data.size // mbs
    return make_processed_microbatch_iterator(iterator, tokenizer, cfg, cp_size), length


def process_global_batch(data, loss_fn, dp_group, *, batch_idx, batch_size):
    batch = data.get_batch(batch_idx=batch_idx, batch_size=batch_size)
    seqs = torch.sum(batch["sample_mask"])
    toks = torch.sum(batch["token_mask"][:, 1:] * batch["sample_mask"].unsqueeze(-1))
    return {"batch": batch, "global_valid_seqs": seqs, "global_valid_toks": toks}
'''

# v0.6.0+ ``nemo_rl.models.automodel.train``
AUTOMODEL_TRAIN = '''
from functools import partial

from nemo_rl.algorithms.loss import prepare_loss_input


def model_forward(model, processed_inputs, **kwargs):
    return model(**processed_inputs)


def extract_logits(model, outputs):
    return outputs.logits


def apply_temperature_scaling(logits, sampling_params):
    if sampling_params is not None and sampling_params.temperature != 1.0:
        logits.div_(sampling_params.temperature)
    return logits


class LossPostProcessor:
    def __init__(self, loss_fn, cfg, device_mesh, cp_mesh, tp_mesh, cp_size, dp_size, enable_seq_packing=False,
                 sampling_params=None):
        self.loss_fn, self.cfg, self.cp_size, self.dp_size = loss_fn, cfg, cp_size, dp_size
        self.enable_seq_packing, self.sampling_params = enable_seq_packing, sampling_params

    def __call__(self, logits, data_dict, processed_inputs, global_valid_seqs, global_valid_toks, sequence_dim=1):
        loss_input, data_dict = partial(prepare_loss_input, sampling_params=self.sampling_params)(
            logits, data_dict, self.loss_fn)
        return self.loss_fn(data=data_dict, global_valid_seqs=global_valid_seqs, global_valid_toks=global_valid_toks,
                            **loss_input)


def forward_with_post_processing_fn(model, post_processing_fn, processed_mb, is_reward_model=False,
                                    allow_flash_attn_args=True, global_valid_seqs=None, global_valid_toks=None,
                                    sampling_params=None, sequence_dim=1):
    outputs = model_forward(model, processed_mb.processed_inputs)
    logits = extract_logits(model, outputs)
    logits = apply_temperature_scaling(logits, sampling_params)
    result, metrics = post_processing_fn(logits=logits, data_dict=processed_mb.data_dict,
                                         processed_inputs=processed_mb.processed_inputs,
                                         global_valid_seqs=global_valid_seqs, global_valid_toks=global_valid_toks,
                                         sequence_dim=sequence_dim)
    return result, metrics, processed_mb


def automodel_forward_backward(model, data_iterator, post_processing_fn, forward_only=False, global_valid_seqs=None,
                               global_valid_toks=None, sampling_params=None, dp_size=1, cp_size=1,
                               num_global_batches=1, num_valid_microbatches=None):
    results = []
    for mb_idx, processed_mb in enumerate(data_iterator):
        result, metrics, _ = forward_with_post_processing_fn(
            model=model, post_processing_fn=post_processing_fn, processed_mb=processed_mb,
            global_valid_seqs=global_valid_seqs, global_valid_toks=global_valid_toks, sampling_params=sampling_params)
        if num_valid_microbatches is not None and mb_idx >= num_valid_microbatches:
            result = result * 0
        else:
            for k in metrics:
                if "_min" not in k and "_max" not in k:
                    metrics[k] /= num_global_batches
        if not forward_only:
            (result * dp_size * cp_size).backward()
        results.append((result, metrics))
    return results
'''

WORKER_COMMON = '''
from collections import defaultdict

import torch

from nemo_rl.distributed.batched_data_dict import BatchedDataDict


class _Mesh:
    def get_group(self):
        return None


def ray_remote(cls):
    """``@ray.remote``'s shape: the module attribute is a handle; the class is reachable from it."""
    handle = type("ActorClass", (), {})()
    handle.__ray_metadata__ = type("M", (), {"modified_class": type("C", (), {"__ray_actor_class__": cls})})()
    return handle


def _metrics(all_mb_metrics, losses):
    merged = defaultdict(list)
    for m in all_mb_metrics:
        for k, v in m.items():
            merged[k].append(v)
    return {"global_loss": torch.tensor(losses), "all_mb_metrics": dict(merged)}


def _logprobs(self, data):
    with torch.no_grad():
        logits = self.model(input_ids=data["input_ids"]).logits.float()
        if self.sampling_params is not None:
            logits = logits / self.sampling_params.temperature
        lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, data["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    out = torch.zeros(data["input_ids"].shape)
    out[:, 1:] = lp
    return out


def _init(self, model, cfg, lr=0.1):
    self.model, self.cfg = model, cfg
    self.optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    self.dp_mesh, self.dp_size, self.cp_size, self.tp_size = _Mesh(), 1, 1, 1
    self.enable_seq_packing, self.sampling_params, self.tokenizer = False, None, None
    self.step_grads = []
    self.reference = None


def _step(self):
    self.step_grads.append(torch.cat([p.grad.reshape(-1).clone() if p.grad is not None else torch.zeros(p.numel())
                                      for p in self.model.parameters()]))
    self.optimizer.step()
'''

WORKER_V05 = WORKER_COMMON + '''

class _Worker:
    def __init__(self, model, cfg, lr=0.1):
        _init(self, model, cfg, lr)

    def train(self, data, loss_fn, eval_mode=False, gbs=None, mbs=None):
        gbs = gbs or self.cfg["train_global_batch_size"]
        mbs = mbs or self.cfg["train_micro_batch_size"]
        num_global_batches = data.size // gbs
        losses, all_mb_metrics = [], []
        for gb_idx in range(num_global_batches):
            global_batch = data.get_batch(batch_idx=gb_idx, batch_size=gbs)
            global_valid_seqs = torch.sum(global_batch["sample_mask"])
            global_valid_toks = torch.sum(global_batch["token_mask"][:, 1:] * global_batch["sample_mask"].unsqueeze(-1))
            self.optimizer.zero_grad()
            batch = data.get_batch(batch_idx=gb_idx, batch_size=gbs)
            if self.cfg["dynamic_batching"]["enabled"]:
                mb_iterator = batch.make_microbatch_iterator_with_dynamic_shapes()
                iterator_len = batch.get_microbatch_iterator_dynamic_shapes_len()
            else:
                mb_iterator = batch.make_microbatch_iterator(mbs)
                iterator_len = batch.size // mbs
            mb_losses = []
            for mb_idx, mb in enumerate(mb_iterator):
                logits = self.model(input_ids=mb["input_ids"]).logits
                loss, loss_metrics = loss_fn(logits, mb, global_valid_seqs, global_valid_toks)
                if mb_idx < iterator_len:
                    for k in loss_metrics.keys():
                        loss_metrics[k] /= num_global_batches
                    num_valid_samples = loss_metrics["num_valid_samples"]
                else:
                    loss *= 0
                if not eval_mode:
                    loss.backward()
                if num_valid_samples > 0:
                    mb_losses.append(loss.item())
                    all_mb_metrics.append(loss_metrics)
            if not eval_mode:
                _step(self)
            losses.append(sum(mb_losses))
        return _metrics(all_mb_metrics, losses)

    def get_logprobs(self, data):
        mbs = self.cfg["logprob_batch_size"]
        return BatchedDataDict({"logprobs": torch.cat([_logprobs(self, mb) for mb in data.make_microbatch_iterator(mbs)])})


DTensorPolicyWorkerV2 = ray_remote(_Worker)
'''

WORKER_V06 = WORKER_COMMON + '''
from nemo_rl.models.automodel.data import get_microbatch_iterator, process_global_batch
from nemo_rl.models.automodel.train import LossPostProcessor, automodel_forward_backward


class DTensorPolicyWorkerV2Impl:
    def __init__(self, model, cfg, lr=0.1):
        _init(self, model, cfg, lr)

    def train(self, data, loss_fn, eval_mode=False, gbs=None, mbs=None{extra}):
        gbs = gbs or self.cfg["train_global_batch_size"]
        mbs = mbs or self.cfg["train_micro_batch_size"]
        num_global_batches = data.size // gbs
        post = LossPostProcessor(loss_fn, self.cfg, None, None, None, cp_size=1, dp_size=1,
                                 enable_seq_packing=self.enable_seq_packing, sampling_params=self.sampling_params)
        losses, all_mb_metrics = [], []
        for gb_idx in range(num_global_batches):
            gb_result = process_global_batch(data, loss_fn, self.dp_mesh.get_group(), batch_idx=gb_idx, batch_size=gbs)
            batch = gb_result["batch"]
            self.optimizer.zero_grad()
            processed_iterator, iterator_len = get_microbatch_iterator(batch, self.cfg, mbs, self.dp_mesh,
                                                                       tokenizer=self.tokenizer, cp_size=self.cp_size)
            mb_results = automodel_forward_backward(
                self.model, processed_iterator, post, forward_only=eval_mode,
                global_valid_seqs=gb_result["global_valid_seqs"], global_valid_toks=gb_result["global_valid_toks"],
                sampling_params=self.sampling_params, num_global_batches=num_global_batches,
                num_valid_microbatches=iterator_len)
            mb_losses = []
            for mb_idx, (loss, loss_metrics) in enumerate(mb_results):
                if mb_idx < iterator_len and loss_metrics["num_valid_samples"] > 0:
                    mb_losses.append(loss.item())
                    all_mb_metrics.append(loss_metrics)
            if not eval_mode:
                _step(self)
            losses.append(sum(mb_losses))
        return _metrics(all_mb_metrics, losses)

    def get_logprobs(self, data, micro_batch_size=None):
        iterator, _ = get_microbatch_iterator(data, self.cfg, self.cfg["logprob_batch_size"], self.dp_mesh,
                                              tokenizer=None)  # the same name train() uses
        return BatchedDataDict({{"logprobs": torch.cat([_logprobs(self, mb.data_dict) for mb in iterator])}})


DTensorPolicyWorkerV2 = ray_remote(type("DTensorPolicyWorkerV2", (DTensorPolicyWorkerV2Impl,), {{}}))
'''

LM_POLICY = '''
import copy

from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.policy.workers.dtensor_policy_worker_v2 import DTensorPolicyWorkerV2


class Policy:
    """One in-process worker instead of a Ray worker group."""

    built = []

    def __init__(self, cluster, config, tokenizer, name_prefix="lm_policy", workers_per_node=None,
                 init_optimizer=True, weights_path=None, optimizer_path=None, init_reference_model=True,
                 processor=None):
        self.cfg = config
        worker_class = DTensorPolicyWorkerV2.__ray_metadata__.modified_class.__ray_actor_class__
        self.worker = worker_class(config["model_factory"](), config, lr=config.get("lr", 0.1))
        self.worker.reference = copy.deepcopy(self.worker.model) if init_reference_model else None
        self.calls = {"get_logprobs": 0, "get_reference_policy_logprobs": 0, "train": 0}
        Policy.built.append(self)

    def get_logprobs(self, data, timer=None):
        self.calls["get_logprobs"] += 1
        return self.worker.get_logprobs(data)

    def get_reference_policy_logprobs(self, data, micro_batch_size=None, timer=None):
        self.calls["get_reference_policy_logprobs"] += 1
        assert self.worker.reference is not None, "no reference model was built"
        live, self.worker.model = self.worker.model, self.worker.reference
        try:
            return BatchedDataDict({"reference_logprobs": self.worker.get_logprobs(data)["logprobs"]})
        finally:
            self.worker.model = live

    def train(self, data, loss_fn, eval_mode=False, *, gbs=None, mbs=None, timer=None):
        self.calls["train"] += 1
        import pickle

        loss_fn = pickle.loads(pickle.dumps(loss_fn))  # NeMo-RL ships the loss to the workers on every call
        result = self.worker.train(data, loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs)
        return {"loss": result["global_loss"], "all_mb_metrics": result["all_mb_metrics"]}

    def prepare_for_lp_inference(self):
        pass

    def prepare_for_training(self):
        pass
'''

LOGGER = '''
class Logger:
    def __init__(self):
        self.metrics, self.jsonl, self.plots = [], [], []

    def log_metrics(self, metrics, step, prefix="", step_metric=None{extra}):
        self.metrics.append((prefix, dict(metrics)))

    def log_batched_dict_as_jsonl(self, to_log, filename):
        self.jsonl.append(dict(to_log))

    def log_plot_token_mult_prob_error(self, data, step, name):
        self.plots.append(name)
'''

OPD = '''
def _skip_prev_logprobs(master_config):
    threshold = master_config.grpo.get("seq_logprob_error_threshold", None) if isinstance(master_config.grpo, dict) \\
        else master_config.grpo.seq_logprob_error_threshold
    return bool(master_config.loss_fn.force_on_policy_ratio and threshold is None)
'''

GRPO = '''
import numpy as np
import torch

from {tag_module} import TAG
from nemo_rl.algorithms import {loss_import}
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.policy.lm_policy import Policy
{opd_import}

ClippedPGLossFn = _loss_module.ClippedPGLossFn
PLACEHOLDERS = ("max_seq_mult_prob_error", "mean_seq_mult_prob_error", "min_seq_mult_prob_error",
                "max_seq_mult_prob_error_after_mask", "mean_seq_mult_prob_error_after_mask",
                "min_seq_mult_prob_error_after_mask", "num_masked_seqs_by_logprob_error", "masked_correct_pct")


def _cfg(config, section):
    return config[section] if isinstance(config, dict) else getattr(config, section)


def setup(master_config, tokenizer, dataset, val_dataset, processor=None{setup_extra}):
    loss_config = _cfg(master_config, "loss_fn")
    if TAG in ("v0.7.0", "main"):
        init_reference_model = loss_config.reference_policy_kl_penalty > 0
        if not init_reference_model:
            _cfg(master_config, "grpo")["skip_reference_policy_logprobs_calculation"] = True
        policy = Policy(None, _cfg(master_config, "policy"), tokenizer, init_reference_model=init_reference_model)
    else:
        policy = Policy(None, _cfg(master_config, "policy"), tokenizer)
    loss_fn = ClippedPGLossFn(loss_config)
    return policy, None, None, dataset, None, loss_fn, None, None, master_config


def compute_and_apply_seq_logprob_error_masking(train_data, rewards, seq_logprob_error_threshold):
    mask = train_data["token_mask"][:, 1:] * train_data["sample_mask"].unsqueeze(-1)
    error = torch.abs(train_data["generation_logprobs"][:, 1:] - train_data["prev_logprobs"][:, 1:])
    per_seq = (torch.exp(error * mask) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    if TAG == "v0.6.0":
        return float(per_seq.max()), 0, 0.0
    return {{"max_seq_mult_prob_error": float(per_seq.max()), "mean_seq_mult_prob_error": float(per_seq.mean()),
            "min_seq_mult_prob_error": float(per_seq.min()), "num_masked_seqs": 0}}


def _placeholder_seq_logprob_error_metrics():
    return {{k: 0.0 for k in PLACEHOLDERS}}


def _resolve_logprob_skip_flags(master_config):
    return opd_module._skip_prev_logprobs(master_config), _cfg(master_config, "grpo").get(
        "skip_reference_policy_logprobs_calculation")


def _setting(config, section, key, default=None):
    part = _cfg(config, section)
    return part.get(key, default) if isinstance(part, dict) else getattr(part, key, default)


def grpo_train(policy, policy_generation, dataloader, val_dataloader, tokenizer, loss_fn, task_to_env,
               val_task_to_env, logger, checkpointer, grpo_save_state, master_config, processor=None):
    for step, batch in enumerate(dataloader):
        train_data = BatchedDataDict({{k: v.clone() for k, v in batch.items()}})
        logprob_data = BatchedDataDict({{k: train_data[k] for k in ("input_ids", "token_mask", "sample_mask")}})
        metrics = {{}}
        if TAG == "v0.5.0":
            train_data["prev_logprobs"] = policy.get_logprobs(train_data)["logprobs"]
            train_data["reference_policy_logprobs"] = policy.get_reference_policy_logprobs(train_data)["reference_logprobs"]
        elif TAG == "v0.6.0":
            train_data["prev_logprobs"] = policy.get_logprobs(logprob_data, timer=None)["logprobs"]
            if not _cfg(master_config, "grpo").get("skip_reference_policy_logprobs_calculation"):
                train_data["reference_policy_logprobs"] = policy.get_reference_policy_logprobs(logprob_data)[
                    "reference_logprobs"]
            m, n, c = compute_and_apply_seq_logprob_error_masking(train_data, None, _setting(
                master_config, "grpo", "seq_logprob_error_threshold"))
            seq_metrics = {{"max_seq_mult_prob_error": m, "num_masked_seqs_by_logprob_error": n, "masked_correct_pct": c}}
        else:
            if TAG == "main":
                skip_prev, skip_ref = _resolve_logprob_skip_flags(master_config)
            else:
                skip_prev = opd_module._skip_prev_logprobs(master_config)
                skip_ref = _cfg(master_config, "grpo").get("skip_reference_policy_logprobs_calculation")
            if not (skip_prev and skip_ref):
                policy.prepare_for_lp_inference()
            if not skip_prev:
                train_data["prev_logprobs"] = policy.get_logprobs(logprob_data, timer=None)["logprobs"]
            else:
                train_data["prev_logprobs"] = torch.zeros_like(train_data["generation_logprobs"])
            if not skip_ref:
                train_data["reference_policy_logprobs"] = policy.get_reference_policy_logprobs(logprob_data)[
                    "reference_logprobs"]
            else:
                train_data["reference_policy_logprobs"] = torch.zeros_like(train_data["prev_logprobs"])
            if skip_prev:
                seq_metrics = _placeholder_seq_logprob_error_metrics() if TAG == "main" else {{
                    k: 0.0 for k in PLACEHOLDERS}}
            else:
                seq_metrics = compute_and_apply_seq_logprob_error_masking(train_data, None, None)
        policy.prepare_for_training()
        train_results = policy.train(train_data, loss_fn, timer=None)
        metrics.update(train_results["all_mb_metrics"])
        for k, v in metrics.items():
            if k in {{"probs_ratio_min", "probs_ratio_clamped_min"}}:
                metrics[k] = np.min([x for x in v if not np.isinf(x)] or [-1.0]).item()
            elif k in {{"probs_ratio_max", "probs_ratio_clamped_max"}}:
                metrics[k] = np.max([x for x in v if not np.isinf(x)] or [-1.0]).item()
            elif k in {{"lr", "global_valid_seqs", "global_valid_toks"}}:
                metrics[k] = np.mean(v).item()
            else:
                metrics[k] = np.sum(v).item()
        if TAG != "v0.5.0":
            metrics.update(seq_metrics)
        logger.log_batched_dict_as_jsonl({{"prev_logprobs": train_data["prev_logprobs"].tolist()}},
                                         f"train_data_step{{step}}.jsonl")
        if metrics["token_mult_prob_error"] > 1.05:
            logger.log_plot_token_mult_prob_error({{"prev_logprobs": train_data["prev_logprobs"]}}, step,
                                                  name="train/token_mult_prob_error_plot_sample")
        logger.log_metrics(metrics, step, prefix="train")


def async_grpo_train(*args, **kwargs):
    raise NotImplementedError
'''


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"))


def make_source(root: Path, tag: str) -> Path:
    """Write the stand-in ``nemo_rl`` of ``tag`` under ``root`` (put ``root`` on ``sys.path``)."""
    assert tag in TAGS, tag
    pkg = root / "nemo_rl"
    for sub in ("", "algorithms", "distributed", "models", "models/policy", "models/policy/workers", "utils"):
        _write(pkg / sub / "__init__.py", "")
    _write(pkg / "_tag.py", f"TAG = {tag!r}\n")
    _write(pkg / "package_info.py", PACKAGE_INFO.format(*VERSIONS[tag]))
    _write(pkg / "distributed" / "batched_data_dict.py", BATCHED_DATA_DICT)
    _write(pkg / "models" / "tiny.py", MODEL)
    main = tag == "main"
    loss = LOSS.format(
        tag_module="nemo_rl._tag",
        fused_arg=", use_fused_linear_logprobs=False" if main else "",
        fused_body="self.use_fused_linear_logprobs = use_fused_linear_logprobs" if main else "pass",
        call=CALL_V05 if tag == "v0.5.0" else CALL_V06,
    )
    if tag == "v0.5.0":
        _write(pkg / "algorithms" / "loss_functions.py", loss)
        _write(pkg / "models" / "policy" / "workers" / "dtensor_policy_worker_v2.py", WORKER_V05)
        loss_import = "loss_functions as _loss_module"
    else:
        _write(pkg / "algorithms" / "loss" / "__init__.py", LOSS_PACKAGE_INIT)
        _write(pkg / "algorithms" / "loss" / "loss_functions.py", loss)
        _write(pkg / "algorithms" / "loss" / "utils.py", LOSS_UTILS)
        _write(pkg / "models" / "automodel" / "__init__.py", "")
        _write(pkg / "models" / "automodel" / "data.py", AUTOMODEL_DATA)
        _write(pkg / "models" / "automodel" / "train.py", AUTOMODEL_TRAIN)
        extra = ", check_dim_skip_keys=None" if tag != "v0.6.0" else ""
        _write(pkg / "models" / "policy" / "workers" / "dtensor_policy_worker_v2.py",
               WORKER_V06.replace("{extra}", extra).replace("{{", "{").replace("}}", "}"))
        loss_import = "loss as _loss_pkg\nfrom nemo_rl.algorithms.loss import loss_functions as _loss_module"
    _write(pkg / "models" / "policy" / "lm_policy.py", LM_POLICY)
    _write(pkg / "utils" / "logger.py", LOGGER.format(extra=", step_finished=False" if tag != "v0.5.0" else ""))
    new_line = tag in ("v0.7.0", "main")
    if new_line:
        _write(pkg / "algorithms" / "opd.py", OPD)
    _write(pkg / "algorithms" / "grpo.py", GRPO.format(
        tag_module="nemo_rl._tag", loss_import=loss_import,
        opd_import="from nemo_rl.algorithms import opd as opd_module" if new_line else "",
        setup_extra=", policy_factory=None" if new_line else ""))
    return root


class Section(dict):
    """A config section read both ways, like v0.7.0+'s pydantic models (``cfg.key``) and dicts."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value) -> None:
        self[name] = value


def master_config(tag: str, *, loss: dict | None = None, grpo: dict | None = None, policy: dict | None = None):
    """``master_config`` as each tag holds it: dicts on v0.5 / v0.6, attribute objects from v0.7."""
    loss_cfg = {"reference_policy_kl_penalty": 0.0, "ratio_clip_min": 0.2, "ratio_clip_max": 0.28,
                "ratio_clip_c": None, "token_level_loss": True, **(loss or {})}
    grpo_cfg = {"num_prompts_per_step": 2, "num_generations_per_prompt": 4, "seq_logprob_error_threshold": None,
                **(grpo or {})}
    policy_cfg = {"train_global_batch_size": 8, "train_micro_batch_size": 2, "logprob_batch_size": 4,
                  "dynamic_batching": {"enabled": False}, **(policy or {})}
    if tag in ("v0.5.0", "v0.6.0"):
        return {"loss_fn": loss_cfg, "grpo": grpo_cfg, "policy": policy_cfg}
    # pydantic models from v0.7.0: every field has a default
    loss_cfg = {"force_on_policy_ratio": False, "use_importance_sampling_correction": False, "disable_ppo_ratio": False,
                "use_kl_in_reward": False, "use_cispo": False, "positive_example_nll_weight": 0.0, **loss_cfg}
    grpo_cfg = {"skip_reference_policy_logprobs_calculation": False, **grpo_cfg}
    return Section(loss_fn=Section(loss_cfg), grpo=Section(grpo_cfg) if tag == "main" else dict(grpo_cfg),
                   policy=policy_cfg)
