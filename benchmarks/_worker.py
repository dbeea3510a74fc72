"""One benchmark job in a fresh process: the dense fp32 reference, or one timed implementation.

Run by ``lm_head_loss.py`` as ``python benchmarks/_worker.py '<json spec>'``; writes one JSON result
to ``spec["result_path"]``. A fresh process per job keeps each peak-memory reading clean.

Peak extra memory, CPU: before each timed fwd+bwd the process's peak-RSS mark is reset to the current
RSS (``echo 5 > /proc/self/clear_refs``, Linux ≥ 4.0); after it, ``VmHWM - VmRSS(before)`` from
/proc/self/status is the call's peak growth over what the inputs already hold. The kernel keeps the
mark, so nothing is sampled and short spikes are not missed. Fallback where clear_refs is not
writable: ``ru_maxrss`` after the call minus RSS before (valid only if the call set a new maximum).
CUDA: ``torch.cuda.max_memory_allocated() - memory_allocated()`` around the call.
"""

from __future__ import annotations

import gc
import json
import math
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _impls import BUILDERS, Unavailable, dense_token_logps  # noqa: E402

OLD_LOGP_NOISE = 0.15  # spread of log(pi/pi_old): makes ~20% of tokens clip at ε = 0.2


def _status_kb(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


class PeakMemory:
    """Peak memory growth of one call over the memory held just before it, in bytes."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.method = "cuda.max_memory_allocated" if device == "cuda" else "VmHWM after clear_refs=5"
        if device != "cuda":
            try:
                open("/proc/self/clear_refs", "w").write("5")
            except OSError:
                self.method = "ru_maxrss delta (clear_refs not writable)"

    def start(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        self.base = _status_kb("VmRSS") * 1024
        if self.method.startswith("VmHWM"):
            open("/proc/self/clear_refs", "w").write("5")

    def stop(self) -> int:
        if self.device == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        if self.method.startswith("VmHWM"):
            return _status_kb("VmHWM") * 1024 - self.base
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - self.base


def make_inputs(spec: dict, dtype: torch.dtype, device: str, old_logps: torch.Tensor | None) -> dict:
    """The same seeded inputs in every process: rows of T tokens, per-row advantages, a prefix mask."""
    n, h, v, rows = spec["tokens"], spec["hidden"], spec["vocab"], spec["rows"]
    g = torch.Generator().manual_seed(spec["seed"])
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g).mul_(0.02)
    labels = torch.randint(0, v, (n,), generator=g)
    t = n // rows
    advantages = torch.randn(rows, generator=g).repeat_interleave(t)
    # Each row keeps a random prefix of at least min_keep * T tokens (min_keep 1.0: no padding).
    lengths = torch.randint(min(t, math.ceil(spec["min_keep"] * t)), t + 1, (rows,), generator=g)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).reshape(-1)
    inputs = {
        "hidden": hidden.to(device=device, dtype=dtype).requires_grad_(),
        "weight": weight.to(device=device, dtype=dtype).requires_grad_(),
        "labels": labels.to(device), "advantages": advantages.to(device), "mask": mask.to(device),
        "rows": rows,
    }
    if old_logps is not None:
        inputs["old_logps"] = old_logps.to(device)
    return inputs


def fwd_bwd(step, inputs: dict) -> torch.Tensor:
    inputs["hidden"].grad = None
    inputs["weight"].grad = None
    loss = step(inputs)
    loss.backward()
    return loss


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_reference(spec: dict) -> dict:
    """fp32 dense on the (dtype-rounded) inputs: old log-probs for everyone, then loss and grads to compare."""
    dtype = getattr(torch, spec["dtype"])
    inputs = make_inputs(spec, dtype, "cpu", None)
    for key in ("hidden", "weight"):  # the reference sees exactly the values the timed runs see
        inputs[key] = inputs[key].detach().float().requires_grad_()
    with torch.no_grad():  # current log-probs in 512-token chunks, then seeded noise -> "old" policy
        logps = torch.cat([dense_token_logps(hc, inputs["weight"], lc)
                           for hc, lc in zip(inputs["hidden"].split(512), inputs["labels"].split(512))])
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    inputs["old_logps"] = logps + OLD_LOGP_NOISE * torch.randn(logps.shape, generator=g)
    loss = fwd_bwd(BUILDERS["dense"](spec), inputs)
    torch.save({"old_logps": inputs["old_logps"], "loss": loss.detach(),
                "grad_hidden": inputs["hidden"].grad, "grad_weight": inputs["weight"].grad}, spec["ref_path"])
    return {"status": "ok", "loss": loss.item()}


def run_timed(spec: dict) -> dict:
    device, dtype = spec["device"], getattr(torch, spec["dtype"])
    ref = torch.load(spec["ref_path"])
    old_logps = ref.pop("old_logps")
    del ref  # loaded again after timing, so the reference grads do not sit in memory meanwhile
    try:
        step = BUILDERS[spec["impl"]](spec)
    except Unavailable as exc:
        return {"status": str(exc)}
    inputs = make_inputs(spec, dtype, device, old_logps)
    try:
        for _ in range(spec["warmup"]):
            fwd_bwd(step, inputs)
    except NotImplementedError as exc:
        return {"status": f"not implemented ({exc})"}
    mem = PeakMemory(device)
    times, peaks = [], []
    for _ in range(spec["repeats"]):
        inputs["hidden"].grad = inputs["weight"].grad = None
        gc.collect()
        mem.start()
        t0 = time.perf_counter()
        loss = fwd_bwd(step, inputs)
        _sync(device)
        times.append(time.perf_counter() - t0)
        peaks.append(mem.stop())
    ref = torch.load(spec["ref_path"])
    diff = {
        name: (inputs[key].grad.float().cpu() - ref[f"grad_{key}"]).abs().max().item()
        for name, key in (("grad_hidden", "hidden"), ("grad_weight", "weight"))
    }
    return {
        "status": "ok", "times_s": times, "time_median_s": statistics.median(times),
        "peaks_bytes": peaks, "peak_extra_bytes": max(peaks), "mem_method": mem.method,
        "loss": loss.item(), "loss_abs_diff": abs(loss.item() - ref["loss"].item()),
        "max_grad_diff_hidden": diff["grad_hidden"], "max_grad_diff_weight": diff["grad_weight"],
        "max_grad_diff": max(diff.values()), "torch_threads": torch.get_num_threads(),
        "grpo_patches_from": _grpo_patches_path(),
    }


def _grpo_patches_path() -> str | None:
    """Where this process's grpo_patches came from (the baseline impl imports another tree)."""
    module = sys.modules.get("grpo_patches")
    return None if module is None else str(Path(module.__file__).resolve().parent)


def main() -> None:
    spec = json.loads(sys.argv[1])
    torch.set_num_threads(spec["threads"])
    try:
        result = run_reference(spec) if spec["impl"] == "reference" else run_timed(spec)
    except Exception as exc:  # one broken implementation must not stop the benchmark
        traceback.print_exc()
        result = {"status": f"error: {type(exc).__name__}: {exc}"[:300]}
    Path(spec["result_path"]).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
