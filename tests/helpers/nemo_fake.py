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
  sequence-level metrics; no reference model at KL 0; the Megatron worker module's names the
  adapter wraps (signatures only: the real worker runs in the ``*-megatron`` compat cells).
* main: like v0.7.0, ``package_info`` still says 0.6.0, ``use_fused_linear_logprobs``,
  ``_resolve_logprob_skip_flags`` and ``_placeholder_seq_logprob_error_metrics``.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from grpo_patches_testing.nemo_rl_tags import master_config  # noqa: F401  (the tests read it here)
from tests.helpers.nemo_fake_loss import BATCHED_DATA_DICT, CALL_V05, CALL_V06, LOSS, LOSS_PACKAGE_INIT, LOSS_UTILS, MODEL
from tests.helpers.nemo_fake_worker import AUTOMODEL_DATA, AUTOMODEL_TRAIN, WORKER_V05, WORKER_V06

TAGS = ("v0.5.0", "v0.6.0", "v0.7.0", "main")
VERSIONS = {"v0.5.0": (0, 5, 0, "rc0"), "v0.6.0": (0, 6, 0, ""), "v0.7.0": (0, 7, 0, ""), "main": (0, 6, 0, "")}
READS_AS = {"v0.5.0": "0.5.0rc0", "v0.6.0": "0.6.0", "v0.7.0": "0.7.0", "main": "0.8.0.dev0"}

PACKAGE_INFO = """
MAJOR = {0}
MINOR = {1}
PATCH = {2}
PRE_RELEASE = "{3}"
"""

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
        worker_class = DTensorPolicyWorkerV2.__ray_metadata__.modified_class  # the class a Ray actor runs
        self.worker = worker_class(config["model_factory"](), config, lr=config.get("lr", 0.1))
        self.worker.reference = copy.deepcopy(self.worker.model) if init_reference_model else None
        self.calls = {"get_logprobs": 0, "get_reference_policy_logprobs": 0, "train": 0}
        self.log = []  # the worker calls in order (the inference bracket around a pass included)
        Policy.built.append(self)

    def get_logprobs(self, data, timer=None):
        self.calls["get_logprobs"] += 1
        self.log.append("get_logprobs")
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
        self.log.append("train")
        import pickle

        loss_fn = pickle.loads(pickle.dumps(loss_fn))  # NeMo-RL ships the loss to the workers on every call
        result = self.worker.train(data, loss_fn, eval_mode=eval_mode, gbs=gbs, mbs=mbs)
        return {"loss": result["global_loss"], "all_mb_metrics": result["all_mb_metrics"]}

    def prepare_for_lp_inference(self):
        self.log.append("prepare_for_lp_inference")

    def prepare_for_training(self):
        self.log.append("prepare_for_training")
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
        print(f"Loss: {{metrics['loss']:.4f}} Generation KL Error: {{metrics['gen_kl_error']:.4f}}")  # as grpo_train
        if metrics["token_mult_prob_error"] > 1.05:
            logger.log_plot_token_mult_prob_error({{"prev_logprobs": train_data["prev_logprobs"]}}, step,
                                                  name="train/token_mult_prob_error_plot_sample")
        logger.log_metrics(metrics, step, prefix="train")


def async_grpo_train(*args, **kwargs):
    return "async loop ran"
'''


#: The ``megatron_policy_worker`` module (v0.6.0+), only the names it imports that the adapter wraps.
MEGATRON_WORKER = '''
def process_global_batch(data, loss_fn, dp_group, *, batch_idx, batch_size):
    raise NotImplementedError("stand-in: the real Megatron worker runs in the compat cell")


def get_microbatch_iterator(data, cfg, mbs, straggler_timer, seq_length_key=None, delegate_pack_to_model=False):
    raise NotImplementedError("stand-in: the real Megatron worker runs in the compat cell")


def aggregate_training_statistics(all_mb_metrics, losses, data_parallel_group):
    raise NotImplementedError("stand-in: the real Megatron worker runs in the compat cell")
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
    if tag != "v0.5.0":  # the adapter wraps the Megatron worker module on v0.6.0+
        _write(pkg / "models" / "policy" / "workers" / "megatron_policy_worker.py", MEGATRON_WORKER)
    _write(pkg / "algorithms" / "grpo.py", GRPO.format(
        tag_module="nemo_rl._tag", loss_import=loss_import,
        opd_import="from nemo_rl.algorithms import opd as opd_module" if new_line else "",
        setup_extra=", policy_factory=None" if new_line else ""))
    return root
