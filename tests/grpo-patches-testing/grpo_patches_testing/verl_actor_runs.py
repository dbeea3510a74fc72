"""verl's own actor update on a CPU, for the verl tests and benchmarks: a tiny Qwen2 (fp32, eager), verl-shaped rollout batches,
gloo process groups, and runners for verl's own update on both code lines, patches off or on.

* legacy (0.6.1-0.7.1): ``DataParallelPPOActor.update_policy`` on a plain or FSDP2-sharded model;
* engine (0.8.0-0.9.1): ``TrainingWorker.train_mini_batch``: :mod:`verl_engine_runs`, on this
  module's model and batches.

Each run records the gradient before every optimizer step, the metrics verl returns, and the
rows that went through the model with and without autograd (a forward pre-hook).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import torch

try:
    VERL = metadata.version("verl")
except metadata.PackageNotFoundError:  # the main suite: every verl test skips
    VERL = None

PROMPT, RESPONSE, VOCAB, ROWS = 6, 8, 256, 16
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
#: Rows with advantage exactly 0: a block (whole micro-batches are zero) or spread over all of them;
#: ``sparse``: 11 of 16 (kept rows 0, 3, 6, 9, 13: counts that are no multiple of a micro-batch size).
ZERO_ROWS = {"grouped": tuple(range(4, 12)), "interleaved": (1, 2, 4, 5, 9, 10, 11, 14),
             "sparse": (1, 2, 4, 5, 7, 8, 10, 11, 12, 14, 15)}


def line() -> str | None:
    if VERL is None:
        return None
    from grpo_patches.adapters.verl.loss_modes import line_of
    from packaging.version import Version

    return line_of(Version(VERL))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_pg(rank: int = 0, world: int = 1, port: int | None = None) -> None:
    """A gloo process group (world size 1 unless spawned ranks share ``port``)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or free_port()), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def tiny_model(seed: int = 0, hidden: int = 64, layers: int = 2, vocab: int = VOCAB, fused: bool = False) -> Any:
    """A tiny Qwen2; ``fused``: with verl's fused-kernel forward (``use_fused_kernels=True``,
    torch backend), patched onto a subclass of its own so the other models keep HF's forward."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, attn_implementation="eager")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (fused_class() if fused else Qwen2ForCausalLM)(config).float()
    if fused:
        from verl.models.transformers.monkey_patch import patch_forward_with_backends

        patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
    return model


def fused_class() -> type:
    """A Qwen2ForCausalLM subclass whose forward verl's fused-kernel patch may replace."""
    from transformers import Qwen2ForCausalLM

    return type("FusedQwen2ForCausalLM", (Qwen2ForCausalLM,), {"__init__": _init_without_view_outputs})


def _init_without_view_outputs(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
    """``__init__`` of the fused classes: a forward hook, registered before FSDP2 shards the model
    (so it runs before FSDP2's own), hands on copies of the log-probs / entropy verl's fused
    forward returns as views (``.view(batch, -1)``). FSDP2 warns about a root module returning a
    view (an in-place op on it would skip its pre-backward hook); nothing writes into them here,
    and a copy has the same values and gradient."""
    from transformers import Qwen2ForCausalLM

    Qwen2ForCausalLM.__init__(self, config, *args, **kwargs)  # both fused classes subclass it directly
    self.register_forward_hook(_copies_of_views)


def _copies_of_views(module: Any, args: Any, output: Any) -> Any:
    for key in ("log_probs", "entropy"):
        value = output.get(key) if hasattr(output, "get") else None
        if isinstance(value, torch.Tensor) and value._base is not None:
            output[key] = value.clone()
    return output


def make_batch(rows: int = ROWS, zero_rows=ZERO_ROWS["interleaved"], seed: int = 1, world: int = 1,
               prompt: int = PROMPT, response: int = RESPONSE, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """A rollout batch as verl's trainer hands it to the actor, ``rows * world`` rows: left-padded
    prompts, right-padded responses, per-token advantages (``zero_rows`` of each rank exactly 0)
    and off-policy old log-probs (so that ratios clip)."""
    g = torch.Generator().manual_seed(seed)
    n = rows * world
    prompt_len = torch.randint(2, prompt + 1, (n,), generator=g)
    resp_len = torch.randint(1, response + 1, (n,), generator=g)
    ids = torch.zeros(n, prompt + response, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i in range(n):
        p, r = int(prompt_len[i]), int(resp_len[i])
        ids[i, prompt - p : prompt + r] = torch.randint(3, vocab, (p + r,), generator=g)
        attn[i, prompt - p : prompt + r] = 1
    adv = torch.randn(n, generator=g)
    for rank in range(world):
        for z in zero_rows:
            adv[rank * rows + z] = 0.0
    mask = attn[:, prompt:].clone()
    batch = {"prompts": ids[:, :prompt].clone(), "input_ids": ids, "attention_mask": attn,
             "position_ids": torch.clamp(attn.cumsum(1) - 1, min=0), "responses": ids[:, prompt:].clone(),
             "response_mask": mask, "advantages": adv[:, None] * mask.float()}
    with torch.no_grad():
        logits = tiny_model(0, vocab=vocab)(input_ids=ids, attention_mask=attn, position_ids=batch["position_ids"]).logits
        logps = torch.log_softmax(logits[:, -response - 1 : -1].float(), -1).gather(-1, batch["responses"][..., None])[..., 0]
    batch["old_log_probs"] = logps + 0.3 * torch.randn(logps.shape, generator=g)
    return batch


def rank_rows(batch: dict, rank: int, rows: int = ROWS) -> dict:
    return {k: v[rank * rows : (rank + 1) * rows] for k, v in batch.items()}


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # FSDP2 DTensor -> the whole tensor


def grads_of(params) -> torch.Tensor:
    return torch.cat([full(p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().flatten()
                      for p in params])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def max_rel(run: "Run", ref: "Run") -> float:
    assert len(run.grads) == len(ref.grads), f"{len(run.grads)} optimizer steps vs {len(ref.grads)}"
    return max(rel(a, b) for a, b in zip(run.grads, ref.grads))


@dataclass
class Run:
    """What one update did: gradients before each optimizer step, metrics, rows through the model."""

    grads: list = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    forwards: int = 0
    grad_rows: int = 0
    nograd_rows: int = 0
    status: dict = field(default_factory=dict)  # grpo_patches.status()["verl"] right after the update
    weights: dict = field(default_factory=dict)  # the model's weights after the update (legacy_run)
    grad_shapes: list = field(default_factory=list)  # (rows, columns) of each padded autograd forward


def count_forwards(model: torch.nn.Module, run: Run) -> None:
    def pre_hook(module, args, kwargs):
        ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]
        rows = int(ids.shape[0]) if not ids.is_nested else int(ids.size(0))
        run.forwards += 1
        if torch.is_grad_enabled():
            run.grad_rows += rows
            if not ids.is_nested:
                run.grad_shapes.append(tuple(ids.shape))
        else:
            run.nograd_rows += rows

    model.register_forward_pre_hook(pre_hook, with_kwargs=True)


def verl_status() -> dict:
    import grpo_patches

    return grpo_patches.status()["verl"]


def patches(options: dict | None) -> None:
    """Enable the verl adapter with ``options`` (``None``: disabled, verl's own code)."""
    import grpo_patches
    from grpo_patches import savings

    grpo_patches.disable("verl")
    if options is not None:
        savings.reset("verl")  # each run's status() shows its own savings
        grpo_patches.enable("verl", **options)


# --- legacy line: DataParallelPPOActor ----------------------------------------------------


def legacy_actor(model, *, agg="token-mean", dynamic=False, mini=ROWS, mbs=3, epochs=1, loss_mode="vanilla",
                 max_tokens=40, **extra):
    from verl.workers.actor.dp_actor import DataParallelPPOActor
    from verl.workers.config import FSDPActorConfig, FSDPEngineConfig
    from verl.workers.config.actor import PolicyLossConfig

    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=mini, ppo_micro_batch_size_per_gpu=mbs,
                             use_dynamic_bsz=dynamic, ppo_max_token_len_per_gpu=max_tokens, ppo_epochs=epochs,
                             loss_agg_mode=agg, policy_loss=PolicyLossConfig(loss_mode=loss_mode),
                             use_torch_compile=False, fsdp_config=FSDPEngineConfig(dtype="float32"), **extra)
    return DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=0.05))


def legacy_run(options: dict | None, *, n_mini=1, zero="interleaved", rank=0, world=1, shard=False,
               batch_extra: dict | None = None, model_seed: int = 0, fused: bool = False,
               dtype: torch.dtype = torch.float32, **config) -> Run:
    """One ``update_policy`` on a fresh tiny model, patched with ``options`` (``None``: off).
    ``fused``: verl's fused-kernel forward (``use_fused_kernels=True``); ``dtype``: the model's
    parameters (and so its compute)."""
    from verl import DataProto

    patches(options)
    run = Run()
    model = tiny_model(model_seed, fused=fused).to(dtype)
    if fused:
        config["use_fused_kernels"] = True
    if shard:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    count_forwards(model, run)
    actor = legacy_actor(model, mini=ROWS // n_mini, **config)
    step = actor._optimizer_step

    def recording_step():
        run.grads.append(grads_of(actor.actor_module.parameters()))
        return step()

    actor._optimizer_step = recording_step
    batch = rank_rows(make_batch(zero_rows=ZERO_ROWS[zero], world=world), rank)
    batch.update({k: v[: len(batch["advantages"])] for k, v in (batch_extra or {}).items()})
    data = DataProto.from_dict(tensors=batch, meta_info={"temperature": 1.0})
    try:
        run.metrics = actor.update_policy(data)
        run.status = verl_status()
        run.weights = {k: full(v).detach().clone() for k, v in model.state_dict().items()}
    finally:
        patches(None)
    return run


# --- engine line: TrainingWorker / FSDPEngine / ppo_loss ---------------------------------

_MODEL_DIR: dict[str, str] = {}


def model_dir(tmp_root: str, fused: bool = False) -> str:
    """The tiny model saved for the engine; ``fused``: the same weights as a model type of its own
    (:func:`fused_types`), so that verl's fused-kernel patch of its class leaves Qwen2 alone."""
    path = os.path.join(tmp_root, "tiny_qwen2_fused" if fused else "tiny_qwen2")
    if not os.path.exists(os.path.join(path, "config.json")):
        model = tiny_model(0)
        if fused:
            config_class, model_class = fused_types()
            fused_model = model_class(config_class(**model.config.to_dict()))
            fused_model.load_state_dict(model.state_dict())
            model = fused_model
        model.save_pretrained(path)
    return path


_FUSED_TYPES: list = []


def fused_types() -> tuple[type, type]:
    """A Qwen2 config / causal-LM pair registered with transformers' auto classes (once per process)."""
    if not _FUSED_TYPES:
        from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

        class FusedQwen2Config(Qwen2Config):
            model_type = "grpo_tiny_fused_qwen2"

        class FusedQwen2ForCausalLM(Qwen2ForCausalLM):
            config_class = FusedQwen2Config
            __init__ = _init_without_view_outputs

        AutoConfig.register(FusedQwen2Config.model_type, FusedQwen2Config)
        AutoModelForCausalLM.register(FusedQwen2Config, FusedQwen2ForCausalLM)
        _FUSED_TYPES.extend([FusedQwen2Config, FusedQwen2ForCausalLM])
    return _FUSED_TYPES[0], _FUSED_TYPES[1]


def trainer_config(use_kl_loss=True, kl_loss_coef=0.0, use_kl_in_reward=False, kl_ctrl="fixed", kl_coef=0.0,
                   mini=16, epochs=1, n=1):
    from omegaconf import OmegaConf

    return OmegaConf.create({
        "actor_rollout_ref": {"actor": {"use_kl_loss": use_kl_loss, "kl_loss_coef": kl_loss_coef,
                                        "ppo_mini_batch_size": mini, "ppo_epochs": epochs,
                                        "loss_agg_mode": "token-mean", "loss_scale_factor": None},
                              "rollout": {"n": n, "temperature": 1.0}},
        "algorithm": {"use_kl_in_reward": use_kl_in_reward, "kl_ctrl": {"type": kl_ctrl, "kl_coef": kl_coef}},
    })
