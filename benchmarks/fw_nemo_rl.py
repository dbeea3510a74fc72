"""The cross-framework workload in NeMo-RL, from a source checkout.

v0.7.0 and main: NeMo-RL's own entry point, ``examples/run_grpo.py``, on a Ray cluster of the
run (:func:`run_entry_point`; how it runs on a CPU: :mod:`grpo_patches_testing.nemo_rl_run_grpo`).

v0.6.0: one process, no Ray. Real NeMo-RL code: the driver's ``Policy.get_logprobs``,
``Policy.get_reference_policy_logprobs`` and ``Policy.train`` (a ``Policy`` built without its
``__init__``, which needs a Ray cluster) whose worker group is a stand-in of one that calls
the real ``DTensorPolicyWorkerV2(Impl)`` ``get_logprobs`` / ``get_reference_policy_logprobs`` /
``train()`` in this process (gloo group of one, CPU; passes are counted there); v0.7.0+'s
``opd._skip_prev_logprobs``, v0.6.0's ``compute_and_apply_seq_logprob_error_masking``, the
``GRPOAdvantageEstimator`` (``calculate_baseline_and_std_per_prompt``) and
``ClippedPGLossFn``: called in the order ``grpo_train`` calls them per step (prev log-probs,
reference log-probs, sequence error metrics, advantages, train). Emulated: the loop body
itself, ``grpo.setup`` (the config it leaves: one optimizer step per rollout batch, KL
penalty 0; v0.7.0+ then skips the reference pass itself, v0.6.0 runs it on a reference copy
of the initial weights) and the worker's ``__init__`` (:mod:`grpo_patches_testing.nemo_rl_cpu`:
CPU shim, ``real_worker``; configs and the loss per tag from :mod:`grpo_patches_testing.nemo_rl_tags`); ``prepare_for_lp_inference`` / ``prepare_for_training``
(memory moves) are not called. Patched runs call ``grpo_patches.enable("nemo_rl")`` (defaults)
and run the adapter's own wrappers of ``grpo.setup``, ``Policy.__init__`` and
``grpo.grpo_train`` around the emulated setup and loop (that is how the adapter knows it is
in ``grpo_train``: ``state.LOOP``). Generation is HF ``generate`` from the policy, timed
apart; ``generation_logprobs`` are zeros (vLLM's; no gradient reads them here). Reported
besides the passes: ``logprob_pass_forwards``, the model forwards the log-prob passes ran (0
when both are skipped); with ``spec["verify_every"]`` (``frameworks.py --verify``) patched runs
turn verify mode on and report its largest figures (``verify_figures``). ``spec["mini_batches"]`` = N
sets ``train_global_batch_size`` to 1/N of the rollout; the old-logprob rows are the rows of the
passes run less ``grpo_patches/old_logprob_rows_skipped`` in NeMo-RL's metrics (absent = 0).
v0.6.0 also reports ``policy_tokens``: rows x columns of ``input_ids`` through the model's
forwards with gradients (the training passes), counted by a forward pre-hook beneath the patches
(the entry-point runs do not count them: the worker is a Ray actor). The patched v0.6.0 run tells
the driver side that its workers are patched (they are this process), as ``grpo-patches run``
does for Ray workers: else ``recompute`` would compute every row.
``variable_lengths`` boosts the tiny model's ``<eos>`` (v0.6.0's HF generation; the entry
point's stand-in generation keeps its own lengths). Called by ``_framework_worker.py``; the source comes on
``PYTHONPATH`` (``frameworks.py --nemo-rl-tag``); v0.5.0 is "not run".
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import workload


class _Group:
    """A worker group of one: the real ``Policy`` methods call it, the real worker answers."""

    def __init__(self, worker: Any) -> None:  # forwards: the model's, to show a skipped pass runs none
        self.worker, self.calls, self.forwards, self.logprob_forwards = worker, {}, [0], 0
        self.policy_tokens = 0  # rows x columns of the forwards with gradients (the training passes)
        worker.model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module: Any, args: tuple, kwargs: dict) -> None:
        import torch

        self.forwards[0] += 1
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and torch.is_grad_enabled():
            self.policy_tokens += int(ids.numel())

    def run_all_workers_sharded_data(self, method: str, data: list, common_kwargs: dict | None = None, **_: Any) -> list:
        self.calls[method] = self.calls.get(method, 0) + 1
        before = self.forwards[0]
        result = getattr(self.worker, method)(data=data[0], **(common_kwargs or {}))
        if method != "train":
            self.logprob_forwards += self.forwards[0] - before
        return [result]

    def get_all_worker_results(self, futures: list) -> list:
        return futures

    def shutdown(self, **_: Any) -> bool:
        return True


def _no_pinned_memory() -> None:
    """The CPU shim's one addition: the worker's reference swap asks for pinned CPU copies."""
    import torch

    empty = torch.empty
    torch.empty = lambda *a, pin_memory=False, **k: empty(*a, **k)


def _worker(tag: str, spec: dict[str, Any], reference: bool) -> Any:
    import torch

    from grpo_patches.demo import tiny_model
    from grpo_patches_testing import nemo_rl_cpu as harness

    rows = spec["prompts"] * spec["generations"]
    worker = harness.real_worker(tag, rows, spec["micro_rows"])
    worker.model = tiny_model.build_model(spec["seed"], spec["hidden"], spec["layers"],
                                          eos_boost=workload.eos_boost(spec)).float()
    worker.optimizer = torch.optim.SGD(worker.model.parameters(), lr=spec["lr"])
    worker.scheduler = torch.optim.lr_scheduler.LambdaLR(worker.optimizer, lambda step: 1.0)
    worker.reference_model_state_dict = ({k: v.detach().clone() for k, v in worker.model.state_dict().items()}
                                         if reference else None)
    return worker


def _fill_policy(policy: Any, worker: Any, config: Any) -> None:
    """What ``Policy.__init__`` leaves that these methods read (a cluster of one worker)."""
    import numpy as np
    from nemo_rl.distributed.named_sharding import NamedSharding

    policy.cfg = config["policy"]
    policy.sharding_annotations = NamedSharding(layout=np.arange(1).reshape(1, 1, 1, 1), names=[
        "pipeline_parallel", "data_parallel", "context_parallel", "tensor_parallel"])
    policy.use_dynamic_batches = policy.use_sequence_packing = False
    policy.flops_tracker = None
    policy.worker_group = _Group(worker)
    # Memory moves (GPU offload), not run in this process (the patched driver's deferred pass runs
    # without them unless they free memory: adapters/nemo_rl/pass_bracket.py).
    policy.prepare_for_lp_inference = policy.prepare_for_training = lambda *a, **k: None


def _setup(tag: str, spec: dict[str, Any], patched: bool) -> tuple[Any, Any]:
    """``grpo.setup`` as far as this workload needs it: the config and the policy, its reference
    model decided as ``setup`` / ``Policy.__init__`` decide (through the adapter's wrappers when patched)."""
    from nemo_rl.models.policy.lm_policy import Policy

    from grpo_patches_testing.nemo_rl_tags import master_config

    old = tag in ("v0.5.0", "v0.6.0")
    rows = spec["prompts"] * spec["generations"]
    grpo = {"num_prompts_per_step": spec["prompts"], "num_generations_per_prompt": spec["generations"]}
    if not old:
        grpo["skip_reference_policy_logprobs_calculation"] = True  # v0.7.0+ setup: KL 0 -> no reference model
    config = master_config(tag, grpo=grpo, policy={"train_global_batch_size": rows // spec.get("mini_batches", 1),
                                                   "train_micro_batch_size": spec["micro_rows"],
                                                   "logprob_batch_size": spec["micro_rows"]})
    policy = object.__new__(Policy)

    def policy_init(init_reference_model: bool = True) -> None:  # Policy.__init__'s reference choice
        _fill_policy(policy, _worker(tag, spec, reference=old and init_reference_model), config)

    def setup(master_config: Any) -> None:
        if patched and old:
            from grpo_patches.adapters.nemo_rl import reference

            reference.init(policy_init, policy, (), {"init_reference_model": True})
        else:
            policy_init(init_reference_model=True)

    if patched:
        from grpo_patches.adapters.nemo_rl import driver_setup

        driver_setup.setup(setup, None, (config,), {})
    else:
        setup(config)
    return config, policy


def _rollouts(model: Any, tokenizer: Any, spec: dict[str, Any], step: int) -> tuple[Any, Any, Any]:
    """Sample and score one step's rollouts; the train data as ``grpo_train`` flattens them (right-padded)."""
    import torch
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    prompts = workload.prompt_texts(spec)
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    torch.manual_seed(spec["seed"] * 1000 + step)
    model.eval()
    with torch.no_grad():
        out = model.generate(**enc, do_sample=True, max_new_tokens=spec["completion_tokens"],
                             num_return_sequences=spec["generations"], pad_token_id=0, eos_token_id=1)
    n, p = spec["generations"], enc["input_ids"].size(1)
    prompt_mask = enc["attention_mask"].repeat_interleave(n, 0).bool()
    prompt_ids = enc["input_ids"].repeat_interleave(n, 0)
    responses = torch.nn.functional.pad(out[:, p:], (0, spec["completion_tokens"] - (out.size(1) - p)))
    ended = (responses == 1).int().cumsum(1)
    response_mask = (ended == 0) | ((ended == 1) & (responses == 1))
    rows, width = len(responses), p + spec["completion_tokens"]
    input_ids, token_mask, lengths = torch.zeros(rows, width, dtype=torch.long), torch.zeros(rows, width), torch.zeros(
        rows, dtype=torch.long)
    for i in range(rows):
        ids = torch.cat([prompt_ids[i][prompt_mask[i]], responses[i][response_mask[i]]])
        plen = int(prompt_mask[i].sum())
        input_ids[i, :len(ids)], token_mask[i, plen:len(ids)], lengths[i] = ids, 1.0, len(ids)
    texts = tokenizer.batch_decode(responses * response_mask, skip_special_tokens=True)
    rewards = torch.tensor([workload.reward(spec, prompts[i // n], t) for i, t in enumerate(texts)])
    data = BatchedDataDict({"input_ids": input_ids, "input_lengths": lengths, "token_mask": token_mask,
                            "generation_logprobs": torch.zeros(rows, width), "sample_mask": torch.ones(rows)})
    return data, rewards, prompt_ids


def _step(tag: str, policy: Any, loss_fn: Any, config: Any, data: Any, rewards: Any, prompt_ids: Any) -> Any:
    """``grpo_train``'s per-step calls from the log-prob pass to ``policy.train``, in its order."""
    import torch
    from nemo_rl.algorithms import grpo
    from nemo_rl.algorithms.advantage_estimator import GRPOAdvantageEstimator
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    skip_prev = False  # v0.5 / v0.6 always call get_logprobs (the adapter answers it when patched)
    if tag not in ("v0.5.0", "v0.6.0"):
        from nemo_rl.algorithms import opd

        skip_prev = opd._skip_prev_logprobs(config)  # read through the module, as grpo_train does
    skip_ref = bool(config["grpo"].get("skip_reference_policy_logprobs_calculation"))
    logprob_data = BatchedDataDict({k: data[k] for k in ("input_ids", "input_lengths", "token_mask", "sample_mask")})
    data["prev_logprobs"] = (torch.zeros_like(data["generation_logprobs"]) if skip_prev
                             else policy.get_logprobs(logprob_data)["logprobs"])
    data["reference_policy_logprobs"] = (torch.zeros_like(data["prev_logprobs"]) if skip_ref
                                         else policy.get_reference_policy_logprobs(logprob_data)["reference_logprobs"])
    if not skip_prev:
        grpo.compute_and_apply_seq_logprob_error_masking(train_data=data, rewards=rewards,
                                                         seq_logprob_error_threshold=None)
    estimator = GRPOAdvantageEstimator({"use_leave_one_out_baseline": True, "normalize_rewards": True},
                                       config["loss_fn"])
    mask = data["token_mask"] * data["sample_mask"].unsqueeze(-1)
    data["advantages"] = estimator.compute_advantage(prompt_ids=prompt_ids, rewards=rewards, mask=mask)
    return policy.train(data, loss_fn)


#: Verify mode's figures in NeMo-RL's metrics (``frameworks.py --verify``).
VERIFY_PREFIX = "grpo_patches/verify/"

#: NeMo-RL's own timers (``timing/train/<name>``, seconds per step) that make up the trainer side.
#: The adapter's count of old-logprob rows not computed, in NeMo-RL's metrics.
ROWS_SKIPPED = "grpo_patches/old_logprob_rows_skipped"
TRAINER_SIDE = ("logprob_inference_prep", "policy_and_reference_logprobs", "training_prep", "policy_training")


def _shape(spec: dict[str, Any]) -> Any:
    """The workload as an end-to-end run's shape: the first ``saturated`` prompts uniform (every
    sample right, or every one wrong: advantage exactly 0), the others mixed."""
    from grpo_patches_testing import nemo_rl_run_grpo as e2e

    patterns = tuple(("all", "none")[i % 2] if i < spec["saturated"] else "even" for i in range(spec["prompts"]))
    return e2e.Shape(prompts_per_step=spec["prompts"], samples=spec["generations"], steps=spec["steps"],
                     micro_batch=spec["micro_rows"], lr=spec["lr"], patterns=patterns, distinct_prompts=spec["prompts"],
                     filler=spec["completion_tokens"] - 2, max_length=spec["completion_tokens"] + 16,
                     hidden=spec["hidden"], layers=spec["layers"], seed=spec["seed"])


def _worker_step(record: dict[str, Any]) -> dict[str, Any]:
    """A step's figures from the worker's record of its train call (``nemo_e2e_cpu``): ``cpu_trainer_side``
    is the worker process's CPU seconds for the step (its ``prepare_for_*`` calls, log-prob pass and
    train call; the driver's own CPU is not in it); ``forwards`` its model calls (with / without grad)."""
    out: dict[str, Any] = {}
    if record.get("step_cpu_seconds") is not None:
        out["cpu_trainer_side"] = record["step_cpu_seconds"]
        out["worker_train_s"] = record.get("train_seconds")
    if "forwards" in record:
        out["forwards"] = record["forwards"]
    return out


def run_entry_point(tag: str, spec: dict[str, Any], patched: bool, weights: str) -> dict[str, Any]:
    """v0.7.0 / main: NeMo-RL's ``examples/run_grpo.py`` itself, as the end-to-end cells run it
    (:mod:`grpo_patches_testing.nemo_rl_run_grpo`: a Ray cluster of this run, the DTensor worker as a Ray actor,
    the CPU stand-ins); patched runs start it through ``grpo-patches run`` (default options).
    Times are NeMo-RL's own timers per step (:data:`TRAINER_SIDE`, each kept under ``stages``;
    ``generation`` apart) and the worker's CPU seconds per step (:func:`_worker_step`); the policy
    calls and tokens are the worker's forwards with gradients (its record of each train call)."""
    import shutil
    import tempfile

    from grpo_patches import registry
    from grpo_patches_testing import nemo_rl_run_grpo as e2e

    shape = _shape(spec)
    root = Path(tempfile.mkdtemp(prefix="nemo-bench-"))
    try:
        files = e2e.assets(root, shape)
        venvs = root / "venvs"
        e2e.worker_venv(venvs)
        with e2e.RayCluster() as cluster:
            options = f"verify_every={spec['verify_every']}" if spec.get("verify_every") else ""
            result = e2e.run_grpo(e2e.source_root(), root / "run", cluster, venvs, files,
                                  shape.rows // spec.get("mini_batches", 1),
                                  options if patched else None, shape=shape, timeout=1500, threads=spec["threads"],
                                  save_calls=(0, shape.steps))
        if result.returncode != 0:
            raise RuntimeError(f"run_grpo.py exited {result.returncode}: {result.output[-3000:]}")
        timing = {name: result.step_values(f"timing/train/{name}") for name in (*TRAINER_SIDE, "generation")}
        stages = [{name: timing[name][i] if i < len(timing[name]) else 0.0 for name in TRAINER_SIDE}
                  for i in range(shape.steps)]
        steps = [{"trainer_side": sum(stages[i].values()), "generation": timing["generation"][i], "stages": stages[i],
                  **_worker_step(result.worker[i] if i < len(result.worker) else {})} for i in range(shape.steps)]
        shutil.copy(result.weights, weights)
        prev_pass = result.scalars.get("timing/train/get_logprobs/shard_data", {})  # NeMo-RL times each pass it runs
        reference = [k for k in result.scalars if k.startswith("timing/train/") and "reference_policy_logprobs" in k
                     and "policy_and_reference" not in k]
        skipped = int(sum(sum(result.step_values(k)) for k in result.scalars if k.endswith(ROWS_SKIPPED)))
        # rows the pass computed: NeMo-RL's own passes, or (its pass deferred into the training worker,
        # NeMo-RL timing none) the rows of every step's pass less the ones the adapter skipped
        passes = len(prev_pass) or (shape.steps if skipped else 0)
        return {"version": str(registry.get("nemo_rl").installed_version()),
                "line": f"{tag} examples/run_grpo.py (Ray)", "steps": steps, "old_logprob_passes": len(prev_pass),
                "reference_passes": max((len(result.scalars[k]) for k in reference), default=0),
                "rows_dropped": int(sum(result.step_values("train/grpo_patches/rows_dropped"))),
                "rows_total": shape.rows * shape.steps, "peak_rss_mb": result.worker[-1]["peak_rss_mb"],
                "old_logprob_rows": shape.rows * passes - skipped, "old_logprob_rows_net": True,
                "old_logprob_rows_skipped": skipped,
                "policy_calls": sum(r.get("forwards", {}).get("grad", [0])[0] for r in result.worker),
                "policy_tokens": sum(r.get("forwards", {}).get("grad", [0, 0, 0])[2] for r in result.worker),
                "micro_batches_dropped": int(sum(result.step_values("train/grpo_patches/micro_batches_dropped"))),
                "verify_figures": {k.split("/", 1)[1]: max(result.step_values(k)) for k in result.scalars
                                   if k.startswith("train/" + VERIFY_PREFIX)}}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _workers_in_this_process(verify_every: int | None) -> None:
    """Tell the driver side that its workers are patched: here the worker runs in this process,
    under the same ``enable()`` (the adapter checks the Ray workers' start-up path instead, which
    a one-process run has none of; without this, ``recompute`` would fall back to every row)."""
    from grpo_patches.adapters.nemo_rl import driver_setup
    from grpo_patches.startup_path import OPTIONS_ENV

    driver_setup.workers_reached = lambda environ=os.environ: (True, "the worker runs in this process")
    os.environ[OPTIONS_ENV] = f"verify_every={verify_every}" if verify_every else ""  # the options it reads


def run(spec: dict[str, Any], patched: bool, weights: str) -> dict[str, Any]:
    from grpo_patches_testing import nemo_rl_cpu as harness

    if harness.tag() in ("v0.7.0", "main"):
        harness.need_worker()
        return run_entry_point(harness.tag(), spec, patched, weights)
    tag = harness.setup()
    _no_pinned_memory()
    if tag == "v0.5.0":
        return {"not_run": "NeMo-RL v0.5.0: no runner in this benchmark (its worker needs its own environment)"}
    harness.need_worker()
    harness.init_gloo(port=int(os.environ.get("MASTER_PORT", "29500")))
    import torch

    import grpo_patches
    from grpo_patches import registry
    from grpo_patches.demo import tiny_model
    from grpo_patches_testing.nemo_rl_tags import make_loss

    if patched:
        _workers_in_this_process(spec.get("verify_every"))
        grpo_patches.enable("nemo_rl", verify_every=spec.get("verify_every"))  # the defaults (frameworks.py --verify: verify mode)
    config, policy = _setup(tag, spec, patched)
    loss_fn, group = make_loss(tag), policy.worker_group
    model, tokenizer = group.worker.model, tiny_model.build_tokenizer()
    steps, dropped, total, figures, skipped = [], 0, 0, {}, 0

    def loop(policy: Any, loss_fn: Any, master_config: Any) -> None:  # grpo_train's signature, as far as read
        nonlocal dropped, total, skipped
        for step in range(spec["steps"]):
            start = time.perf_counter()
            data, rewards, prompt_ids = _rollouts(model, tokenizer, spec, step)
            generation = time.perf_counter() - start
            start, cpu = time.perf_counter(), time.process_time()
            result = _step(tag, policy, loss_fn, master_config, data, rewards, prompt_ids)
            steps.append({"generation": generation, "trainer_side": time.perf_counter() - start,
                          "cpu_trainer_side": time.process_time() - cpu})
            total += int(data["input_ids"].shape[0])
            dropped += int(sum(float(v) for v in result["all_mb_metrics"].get("grpo_patches/rows_dropped", [0])))
            skipped += int(sum(float(v) for v in result["all_mb_metrics"].get(ROWS_SKIPPED, [0])))
            for key, values in result["all_mb_metrics"].items():
                if key.startswith(VERIFY_PREFIX):
                    figures[key] = max([figures.get(key, 0.0), *map(float, values)])

    kwargs = {"policy": policy, "loss_fn": loss_fn, "master_config": config}
    if patched:
        from grpo_patches.adapters.nemo_rl import old_logprobs

        old_logprobs.grpo_train(loop, None, (), kwargs)
    else:
        loop(**kwargs)
    passes = {m: group.calls.get(m, 0) for m in ("get_logprobs", "get_reference_policy_logprobs")}
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, weights)
    return {"version": str(registry.get("nemo_rl").installed_version()), "line": f"{tag} DTensorPolicyWorkerV2",
            "steps": steps, "old_logprob_passes": passes["get_logprobs"],
            "reference_passes": passes["get_reference_policy_logprobs"], "logprob_pass_forwards": group.logprob_forwards,
            "rows_dropped": dropped, "rows_total": total, "verify_figures": figures,
            "old_logprob_rows": passes["get_logprobs"] * spec["prompts"] * spec["generations"],
            "old_logprob_rows_skipped": skipped, "policy_tokens": group.policy_tokens}
