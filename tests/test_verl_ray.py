"""``GRPO_PATCHES=verl`` reaches the processes Ray starts for verl (a real local Ray cluster).

verl's driver starts Ray (``ray.init(runtime_env={"env_vars": ...})``), a ``TaskRunner``
actor builds the trainer, and the workers it creates import the actor modules. Each of those
processes inherits the driver's environment and runs the installed ``grpo_patches_startup.pth``,
so the adapter's records are applied there when verl's modules are imported. The check: a
worker created by a TaskRunner-like actor imports verl's actor module and reports, through
``grpo_patches.status()``, that it is patched, from its own process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from packaging.version import Version

from grpo_patches_testing import verl_actor_runs as h

if h.VERL is None:
    pytest.skip("verl is not installed (the compat cells install it)", allow_module_level=True)
pytest.importorskip("ray")

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import ray

    MODULE = sys.argv[1]

    def report():
        import importlib
        importlib.import_module(MODULE)  # what a verl worker imports when it builds its actor
        import grpo_patches
        verl = grpo_patches.status()["verl"]
        return {"pid": os.getpid(), "process": verl["process"], "patched": verl["patched"],
                "targets": verl.get("targets", []), "options": verl["options"]}

    @ray.remote(num_cpus=0)
    class Worker:
        def status(self):
            return report()

    @ray.remote(num_cpus=0)
    class TaskRunner:  # like verl's: an actor that creates the worker actors
        def run(self):
            worker = Worker.remote()
            return {"runner": report(), "worker": ray.get(worker.status.remote())}

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "true"}, "working_dir": None})
    try:
        out = ray.get(TaskRunner.remote().run.remote())
    finally:
        ray.shutdown()
    out["driver_pid"] = os.getpid()
    print("RESULT " + json.dumps(out))
    """
)


def test_a_ray_worker_started_by_a_task_runner_is_patched(tmp_path):
    module = "verl.workers.actor.dp_actor" if h.line().startswith("legacy") else "verl.workers.engine.fsdp.transformer_impl"
    script = tmp_path / "ray_probe.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "GRPO_PATCHES": "verl", "GRPO_PATCHES_OPTIONS": "zero_advantage_filter=1",
           "RAY_DEDUP_LOGS": "0", "PYTHONPATH": ""}
    proc = subprocess.run([sys.executable, str(script), module], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    import json

    out = json.loads(lines[-1][len("RESULT "):])
    pids = {out["driver_pid"], out["runner"]["pid"], out["worker"]["pid"]}
    assert len(pids) == 3  # three processes: driver, task runner, worker
    for role in ("runner", "worker"):
        report = out[role]
        assert report["patched"], report
        assert f"pid {report['pid']} " in report["process"]  # the report is the worker's own
        assert any(t.startswith(module + ":") for t in report["targets"]), report["targets"]
        assert report["options"]["zero_advantage_filter"] is True  # GRPO_PATCHES_OPTIONS reached it too


PROBE = textwrap.dedent(
    """
    import json, sys
    from types import SimpleNamespace
    import ray

    MODULES = sys.argv[1].split(",")

    @ray.remote(num_cpus=0)
    class Worker:  # imports what verl's actor worker imports, then idles like one
        def __init__(self):
            import importlib
            for name in MODULES:
                importlib.import_module(name)

        def ready(self):
            return True

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        envs = {"patched": {"GRPO_PATCHES": "verl"}, "unpatched": {}}
        workers = {k: Worker.options(runtime_env={"env_vars": v}).remote() for k, v in envs.items()}
        ray.get([w.ready.remote() for w in workers.values()])
        from grpo_patches.adapters.verl.skip_guarantee import _ask, _probe_rows
        out = {k: _ask(SimpleNamespace(workers=[w])) for k, w in workers.items()}
        out["mixed"] = _ask(SimpleNamespace(workers=[workers["patched"], workers["unpatched"]]))
        out["rows"] = {k: _ask(SimpleNamespace(workers=[w]), _probe_rows) for k, w in workers.items()}
    finally:
        ray.shutdown()
    print("RESULT " + json.dumps(out))
    """
)


@pytest.mark.skipif(Version(h.VERL) < Version("0.7"), reason="0.6 has no old-logprob skip")
def test_the_trainer_asks_its_ray_workers_whether_they_substitute(tmp_path):
    """The old-logprob skip needs the workers' substitution: the trainer asks each Ray worker
    (``__ray_call__``, run in the worker's process) and skips only when every one has it
    (a worker with ``logprob_skip`` off: ``test_verl_old_logprob_skip.py``)."""
    from grpo_patches.adapters.verl.skip_guarantee import WORKER_MODULES

    legacy = h.line().startswith("legacy")
    modules = [m for m in WORKER_MODULES if m.endswith("dp_actor") == legacy]
    script = tmp_path / "ray_probe_workers.py"
    script.write_text(PROBE)
    env = {**os.environ, "RAY_DEDUP_LOGS": "0", "PYTHONPATH": "", "RAY_AUTH_MODE": "disabled"}
    env.pop("GRPO_PATCHES", None)
    proc = subprocess.run([sys.executable, str(script), ",".join(modules)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    import json

    out = json.loads(lines[-1][len("RESULT "):])
    assert out["patched"] is None, out
    assert "not enabled in the worker" in out["unpatched"] and "GRPO_PATCHES=verl" in out["unpatched"]
    assert out["mixed"] == out["unpatched"]  # one worker without the substitution is enough to keep the pass
    # the minimal pass's row substitution (recompute, on by default): the same question, its own records
    assert out["rows"]["patched"] is None and "not enabled in the worker" in out["rows"]["unpatched"], out["rows"]
