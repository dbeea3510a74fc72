"""The stand-in NeMo-RL's Automodel training helpers and DTensor policy workers, as source text
(see :mod:`tests.helpers.nemo_fake`)."""

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
from collections import defaultdict
from functools import partial

import torch

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


def aggregate_training_statistics(losses, all_mb_metrics, grad_norm, dp_group, dtype):
    merged = defaultdict(list)
    for m in all_mb_metrics:
        for k, v in m.items():
            merged[k].append(v)
    return {"global_loss": torch.tensor(losses), "grad_norm": grad_norm, "all_mb_metrics": dict(merged)}
'''

WORKER_COMMON = '''
from collections import defaultdict

import torch

from nemo_rl.distributed.batched_data_dict import BatchedDataDict


class _Mesh:
    def get_group(self):
        return None


def ray_remote(cls):
    """``@ray.remote``'s shape: the module attribute is a handle; the class the actor runs is built
    here, at decoration, with every method copied into it (Ray's tracing wrappers): a patch put on
    ``cls`` afterwards does not reach it, the module names its methods call do."""
    def frozen(method):
        def call(self, *args, **kwargs):
            return method(self, *args, **kwargs)

        return call

    actor = type(cls.__name__, (cls,), {"__ray_actor_class__": cls})
    for name, method in list(vars(cls).items()) + [(n, m) for b in cls.__mro__[1:-1] for n, m in vars(b).items()]:
        if callable(method) and not name.startswith("__") and name not in vars(actor):
            setattr(actor, name, frozen(method))
    handle = type("ActorClass", (), {})()
    handle.__ray_metadata__ = type("M", (), {"modified_class": actor})()
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
from nemo_rl.models.automodel.train import LossPostProcessor, aggregate_training_statistics, automodel_forward_backward


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
        return aggregate_training_statistics(losses, all_mb_metrics, None, self.dp_mesh.get_group(), None)

    def get_logprobs(self, data, micro_batch_size=None):
        iterator, _ = get_microbatch_iterator(data, self.cfg, self.cfg["logprob_batch_size"], self.dp_mesh,
                                              tokenizer=None)  # the same name train() uses
        return BatchedDataDict({{"logprobs": torch.cat([_logprobs(self, mb.data_dict) for mb in iterator])}})


DTensorPolicyWorkerV2 = ray_remote(type("DTensorPolicyWorkerV2", (DTensorPolicyWorkerV2Impl,), {{}}))
'''
