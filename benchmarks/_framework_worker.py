"""One run of the cross-framework workload: ``python _framework_worker.py FRAMEWORK PATCHED SPEC WEIGHTS``.

Runs in the framework's own interpreter (a venv with the framework and grpo_patches), with
``GRPO_PATCHES`` unset (the caller's job) so only the runner's ``enable`` patches. Prints ``RESULT {json}``: the
runner's result plus the process's peak RSS (``VmHWM``; a runner whose training runs in another
process, NeMo-RL's Ray worker, reports that one).
"""

from __future__ import annotations

import importlib
import json
import os
import sys


def peak_rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    framework, patched, spec, weights = sys.argv[1], bool(int(sys.argv[2])), json.loads(sys.argv[3]), sys.argv[4]
    import torch

    torch.set_num_threads(spec["threads"])
    runner = importlib.import_module(f"fw_{framework}")
    result = runner.run(spec, patched, weights)
    result.setdefault("peak_rss_mb", peak_rss_mb())  # a runner whose training runs elsewhere gives that process's
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
