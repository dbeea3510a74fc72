"""NeMo-RL's GRPO entry point on a CPU-only machine, for the end-to-end runs only (the compat cells, the benchmark).

Imported by ``sitecustomize.py`` next to this file in every process of a cell's run (driver
and Ray workers) when ``GRPO_PATCHES_E2E_CPU`` is set; nothing here patches what
grpo_patches patches. It supplies what the machine lacks, at import time of the modules
concerned (``wrapt`` post-import hooks):

* CUDA: every ``"cuda"`` placement goes to the CPU, CUDA queries answer harmlessly, NCCL
  process groups become gloo, ``init_device_mesh("cuda")`` becomes ``"cpu"``, no pinned memory;
  the rotary embedding's ``inv_freq`` that Automodel leaves uninitialized is recomputed;
* vLLM: ``grpo.VllmGeneration`` (the class ``grpo.setup`` builds for ``backend=vllm``; NeMo-RL
  has no registry for generation backends) becomes :class:`CpuGeneration`, a stand-in whose
  completions do not depend on the weights: for each prompt of the data file
  (``GRPO_PATCHES_E2E_DATA``, JSON lines ``{"input", "output", "pattern"}``; its tokenizer in
  ``GRPO_PATCHES_E2E_TOKENIZER``) the k-th
  sample ends with the right answer or a wrong one by the row's pattern (``all``: every sample
  right, ``none``: none, ``even``: k even), so groups are mixed or uniform (uniform groups have
  advantage exactly 0), after the row's ``filler`` words (1-3 by sample when absent). ``grpo.refit_policy_generation`` (CUDA IPC / NCCL weight transfer)
  does nothing: the stand-in reads no weights.
* observation: with ``GRPO_PATCHES_E2E_DUMP`` set, the DTensor policy worker writes its weights
  before training (``weights-0.pt``) and after each ``train`` call (``weights-<call>.pt``; only
  the calls ``GRPO_PATCHES_E2E_SAVE_CALLS`` lists, when set) and one JSON line per call (its pid
  and peak RSS, whether grpo_patches is importable there and that process's
  ``grpo_patches.status()``, the loss of each optimizer step, the call's seconds from its first
  global batch to its end (``train_seconds``; ``train_cpu_seconds``: the process's CPU time, steadier
  on a shared host; ``step_cpu_seconds``: since the previous record, so with the log-prob pass and
  the ``prepare_for_*`` calls of the step), and the model's forwards since the previous record: ``forwards``,
  ``{"grad" | "no_grad": [calls, rows, rows x columns]}``, counted by a forward pre-hook beneath
  every patch, so the log-prob passes run before this call are in its record); the driver writes
  its own ``status()`` at exit.

Every attribute these hooks set goes through one ``grpo_patches_testing.cpu_torch.Rebinding``
(the CUDA part is the kit's one shim, :mod:`grpo_patches_testing.cpu_torch`): :func:`uninstall`
puts back what was there.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path
from typing import Any

DATA_ENV = "GRPO_PATCHES_E2E_DATA"
TOKENIZER_ENV = "GRPO_PATCHES_E2E_TOKENIZER"
DUMP_ENV = "GRPO_PATCHES_E2E_DUMP"
_TRAIN_CALLS = [0]
#: The model's forwards since the last train record (``{"grad" | "no_grad": [calls, rows, rows x columns]}``)
#: and the running train call's start (``time.perf_counter()``; ``None`` between calls).
_FORWARDS: dict[str, list[int]] = {"grad": [0, 0, 0], "no_grad": [0, 0, 0]}
_TRAIN_START: list[Any] = [None]
_CPU_MARKS: list[float] = [0.0, 0.0]  # process CPU time at the running call's start, at the last record


def install() -> None:
    import wrapt

    wrapt.register_post_import_hook(_cpu_torch, "torch")
    wrapt.register_post_import_hook(_cpu_device_mesh, "torch.distributed.device_mesh")
    wrapt.register_post_import_hook(_cpu_generation, "nemo_rl.algorithms.grpo")
    wrapt.register_post_import_hook(_rope_from_config, "nemo_rl.models.automodel.setup")
    if os.environ.get(DUMP_ENV):
        wrapt.register_post_import_hook(_observe_data, "nemo_rl.models.automodel.data")
        wrapt.register_post_import_hook(_observe_train, "nemo_rl.models.automodel.train")
        if os.path.basename(sys.argv[0] if sys.argv else "") == "run_grpo.py":
            atexit.register(_dump_driver_status)


# ---------------------------------------------------------------- CUDA -> CPU


def _cpu_torch_module() -> Any:
    """The kit's one CUDA-to-CPU shim; in a Ray worker's own venv the kit is not installed: its folder is two up."""
    try:
        from grpo_patches_testing import cpu_torch
    except ImportError:
        sys.path.append(str(Path(__file__).resolve().parents[2]))
        from grpo_patches_testing import cpu_torch
    return cpu_torch


_SHIM: list[Any] = []  # this process's Rebinding (undone by :func:`uninstall`)


def _rebinding() -> Any:
    if not _SHIM:
        _SHIM.append(_cpu_torch_module().Rebinding())
    return _SHIM[0]


def uninstall() -> None:
    """Undo what the post-import hooks changed in this process."""
    if _SHIM:
        _SHIM[0].undo()


def _cpu_torch(torch: Any) -> None:
    import functools

    cpu_torch, shim = _cpu_torch_module(), _rebinding()
    cpu_torch.factories_on_cpu(shim, torch, drop_pin_memory=True)
    cpu_torch.cuda_is_identity(shim, torch, pin_memory=True)
    cpu_torch.answer_cuda_queries(shim, torch, (
        "empty_cache", "synchronize", "get_device_name", "current_device", "set_device", "reset_peak_memory_stats",
        "max_memory_allocated", "memory_allocated", "memory_reserved", "max_memory_reserved", "mem_get_info"))
    cpu_torch.nvtx_noops(shim, torch)  # NeMo-RL's @wrap_with_nvtx_name needs a CUDA build with NVTX
    import torch.distributed as dist

    init = dist.init_process_group

    @functools.wraps(init)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if "backend" in kwargs:
            kwargs["backend"] = "gloo"
        elif args:
            args = ("gloo", *args[1:])
        return init(*args, **kwargs)

    shim.set(dist, "init_process_group", init_process_group)


def _cpu_device_mesh(module: Any) -> None:
    import functools

    original = module.init_device_mesh

    @functools.wraps(original)
    def init_device_mesh(device_type: str, *args: Any, **kwargs: Any) -> Any:
        return original("cpu" if device_type.startswith("cuda") else device_type, *args, **kwargs)

    _rebinding().set(module, "init_device_mesh", init_device_mesh)


def _rope_from_config(setup: Any) -> None:
    """Automodel builds the model on the meta device and gives non-persistent buffers empty
    storage to be filled by ``initialize_weights``, which does not fill its own rotary
    embedding's ``inv_freq`` (measured on CPU: uninitialized memory, the same batch's log-probs
    differ by ~3e-3 between two runs from the same weights). Recomputed here from the config."""
    import functools

    original = setup.setup_model_and_optimizer

    @functools.wraps(original)
    def setup_model_and_optimizer(*args: Any, **kwargs: Any) -> Any:
        import torch

        state = original(*args, **kwargs)
        model = state[0]
        if os.environ.get(DUMP_ENV):
            model.register_forward_pre_hook(_count_forward, with_kwargs=True)
        with torch.no_grad():
            for name, module in model.named_modules():
                if type(module).__name__.endswith("RotaryEmbedding") and isinstance(getattr(module, "inv_freq", None),
                                                                                    torch.Tensor):
                    fresh = type(module)(config=model.config)
                    wrong = float((module.inv_freq.float() - fresh.inv_freq.float()).abs().max().nan_to_num(1e30))
                    module.inv_freq.copy_(fresh.inv_freq)
                    if hasattr(module, "max_seq_len_cached"):
                        module.max_seq_len_cached = 0  # cos/sin caches are rebuilt from it
                    print(f"nemo_e2e_cpu: {name}.inv_freq recomputed from the config (was off by {wrong:.3g})",
                          file=sys.stderr, flush=True)
        return state

    _rebinding().set(setup, "setup_model_and_optimizer", setup_model_and_optimizer)


def _count_forward(module: Any, args: tuple, kwargs: dict) -> None:
    import torch

    ids = kwargs.get("input_ids", args[0] if args else None)
    counts = _FORWARDS["grad" if torch.is_grad_enabled() else "no_grad"]
    counts[0] += 1
    if ids is not None:
        counts[1] += int(ids.shape[0])
        counts[2] += int(ids.numel())


# ---------------------------------------------------------------- generation stand-in


class CpuGeneration:
    """Stands where ``grpo.setup`` builds ``VllmGeneration(cluster=..., config=...)``."""

    def __init__(self, cluster: Any = None, config: Any = None, **_: Any) -> None:
        from transformers import AutoTokenizer

        self.cfg = config
        self.tokenizer = AutoTokenizer.from_pretrained(os.environ[TOKENIZER_ENV])
        with open(os.environ[DATA_ENV]) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        self.rows = {" ".join(r["input"].split()): r for r in rows}
        self.calls = 0

    def _completion(self, row: dict[str, Any], sample: int) -> list[int]:
        right = {"all": True, "none": False, "even": sample % 2 == 0}[row["pattern"]]
        answer = row["output"] if right else str((int(row["output"]) + 1) % 10)
        words = row.get("filler") or 1 + sample % 3
        filler = [("ba", "be", "bi", "bo")[i % 4] for i in range(words)]
        return [*self.tokenizer.convert_tokens_to_ids([*filler, answer]), self.tokenizer.eos_token_id]

    def generate(self, data: Any, greedy: bool = False) -> Any:
        import torch
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict

        self.calls += 1
        ids, lengths = data["input_ids"], data["input_lengths"]
        seen: dict[str, int] = {}
        outputs = []
        for i in range(ids.shape[0]):
            prompt = ids[i, : int(lengths[i])].tolist()
            text = " ".join(self.tokenizer.decode(prompt, skip_special_tokens=True).split())
            sample = seen[text] = seen.get(text, -1) + 1
            outputs.append((prompt, self._completion(self.rows[text], sample)))
        width = max(len(p) + len(c) for p, c in outputs)
        pad = self.tokenizer.pad_token_id
        out = torch.full((len(outputs), width), pad, dtype=torch.long)
        logprobs = torch.zeros(len(outputs), width)
        for i, (prompt, completion) in enumerate(outputs):
            out[i, : len(prompt) + len(completion)] = torch.tensor(prompt + completion)
            logprobs[i, len(prompt): len(prompt) + len(completion)] = -0.5 - 0.1 * torch.arange(len(completion))
        return BatchedDataDict({
            "output_ids": out,
            "logprobs": logprobs,
            "generation_lengths": torch.tensor([len(c) for _, c in outputs]),
            "unpadded_sequence_lengths": torch.tensor([len(p) + len(c) for p, c in outputs]),
            "truncated": torch.zeros(len(outputs), dtype=torch.bool),
        })

    def prepare_for_generation(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def finish_generation(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def prepare_refit_info(self, state_dict_info: Any) -> None:
        return None

    def init_collective(self, *args: Any, **kwargs: Any) -> list:
        return []

    def clear_logger_metrics(self) -> None:
        return None

    def get_logger_metrics(self) -> dict[str, Any]:
        return {}

    def invalidate_kv_cache(self) -> bool:
        return False

    def shutdown(self) -> bool:
        return True

    @property
    def requires_kv_scale_sync(self) -> bool:
        return False


def _no_refit(*args: Any, **kwargs: Any) -> dict[str, float]:
    """``refit_policy_generation`` moves weights to vLLM over CUDA IPC / NCCL; the stand-in reads none."""
    return {}


def _cpu_generation(grpo: Any) -> None:
    _rebinding().set(grpo, "VllmGeneration", CpuGeneration)
    _rebinding().set(grpo, "refit_policy_generation", _no_refit)


# ---------------------------------------------------------------- observation


def _grpo_patches_report() -> dict[str, Any]:
    import importlib.util

    if importlib.util.find_spec("grpo_patches") is None:
        return {"importable": False}
    import grpo_patches

    return {"importable": True, "file": grpo_patches.__file__, "status": grpo_patches.status()}


def _append(name: str, record: dict[str, Any]) -> None:
    with open(os.path.join(os.environ[DUMP_ENV], name), "a") as f:
        f.write(json.dumps(record, default=str) + "\n")


def _worker_of_caller() -> Any:
    """The DTensor policy worker whose ``train`` is on the stack (the caller of the hooked names)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "train" and frame.f_code.co_filename.endswith("dtensor_policy_worker_v2.py"):
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


def _saves(call: int) -> bool:
    """Whether the weights are saved after train call ``call`` (``GRPO_PATCHES_E2E_SAVE_CALLS``: a comma list; default all)."""
    wanted = os.environ.get("GRPO_PATCHES_E2E_SAVE_CALLS")
    return wanted is None or str(call) in wanted.split(",")


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM:"))


def _save_weights(worker: Any, call: int) -> None:
    import torch

    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in worker.model.state_dict().items()}
    torch.save(state, os.path.join(os.environ[DUMP_ENV], f"weights-{call}.pt"))


def _observe_data(module: Any) -> None:
    """``process_global_batch`` (first of each global batch): the weights before the first train call."""
    import functools

    original = module.process_global_batch

    @functools.wraps(original)
    def process_global_batch(*args: Any, **kwargs: Any) -> Any:
        import time

        worker = _worker_of_caller()
        if worker is not None and _TRAIN_START[0] is None:
            _TRAIN_START[0], _CPU_MARKS[0] = time.perf_counter(), time.process_time()
        if worker is not None and _TRAIN_CALLS[0] == 0 and not getattr(worker, "_e2e_saved_initial", False):
            worker._e2e_saved_initial = True
            if _saves(0):
                _save_weights(worker, 0)
        return original(*args, **kwargs)

    _rebinding().set(module, "process_global_batch", process_global_batch)


def _observe_train(module: Any) -> None:
    """``aggregate_training_statistics`` (the end of a ``train`` call): a record and the weights.

    Hooked on the module that defines it, before the worker module imports it by name: Ray ships
    the worker's methods by value with references to such names (a hook on the worker's own
    ``train`` would never run in the actor)."""
    import functools

    original = module.aggregate_training_statistics

    @functools.wraps(original)
    def aggregate_training_statistics(*args: Any, **kwargs: Any) -> Any:
        import time

        import torch

        result = original(*args, **kwargs)
        worker = _worker_of_caller()
        started, _TRAIN_START[0] = _TRAIN_START[0], None
        if worker is None or not torch.is_grad_enabled():  # eval_mode runs under no_grad
            return result
        seconds = None if started is None else time.perf_counter() - started
        cpu = time.process_time()
        cpu_train, cpu_step = cpu - _CPU_MARKS[0], cpu - _CPU_MARKS[1]
        forwards = {k: list(v) for k, v in _FORWARDS.items()}
        for counts in _FORWARDS.values():
            counts[:] = [0, 0, 0]
        _TRAIN_CALLS[0] += 1
        call = _TRAIN_CALLS[0]
        if _saves(call):
            _save_weights(worker, call)
        _append("worker.jsonl", {"call": call, "pid": os.getpid(), "executable": sys.executable,
                                 "peak_rss_mb": _peak_rss_mb(),
                                 "loss": [float(x) for x in torch.as_tensor(result["global_loss"]).reshape(-1)],
                                 "train_seconds": seconds, "train_cpu_seconds": cpu_train,
                                 "step_cpu_seconds": cpu_step, "forwards": forwards,
                                 "grpo_patches": _grpo_patches_report()})
        _CPU_MARKS[1] = time.process_time()  # the record's own cost (weights, status()) counts in no step
        return result

    _rebinding().set(module, "aggregate_training_statistics", aggregate_training_statistics)


def _dump_driver_status() -> None:
    _append("driver.jsonl", {"pid": os.getpid(), "grpo_patches": _grpo_patches_report()})
