"""The stand-in NeMo-RL's data container, loss and tiny model, as source text (see :mod:`tests.helpers.nemo_fake`)."""

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
