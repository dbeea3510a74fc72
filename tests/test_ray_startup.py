"""The start-up directory reaches Ray actors whose interpreter is another venv, without grpo_patches.

A real local Ray cluster; the actors run in a bare venv (ray, wrapt, packaging only — like a
NeMo-RL worker venv, which lacks pluggy and loses anything ``uv sync`` did not install). The
driver's environment is handed to them the way NeMo-RL does (``ray.init(runtime_env={"env_vars":
dict(os.environ)})``), plus its initializer-actor pattern (an actor with only ``PYTHONPATH``
that creates the worker). The framework is the test-only ``fakefw`` (:mod:`tests.helpers.fakefw_site`).

Runs in the compat session ``ray-startup`` (tag ``ci``), which makes the bare venv and names
it in ``GRPO_PATCHES_RAY_WORKER_PYTHON``; skipped elsewhere.
"""

from __future__ import annotations

import os
import sys

import pytest

from grpo_patches import startup_path
from tests.helpers.fakefw_site import make_site

ray = pytest.importorskip("ray", reason="not run: needs ray (the compat session ray-startup runs it)")
WORKER_PYTHON = os.environ.get("GRPO_PATCHES_RAY_WORKER_PYTHON")
pytestmark = pytest.mark.skipif(not WORKER_PYTHON, reason="not run: GRPO_PATCHES_RAY_WORKER_PYTHON names no bare "
                                                          "worker venv (the compat session ray-startup sets it)")


def _report() -> dict:
    """Runs inside an actor: is it patched, from where, and what leaked in?"""
    import importlib.util
    import sys

    import fakefw.worker
    import grpo_patches

    def origin(name: str) -> str | None:
        spec = importlib.util.find_spec(name)
        return spec.origin if spec else None

    entry = grpo_patches.status()["fakefw"]
    return {"result": fakefw.worker.work(2), "patched": entry["patched"], "process": entry["process"],
            "executable": sys.executable, "pid": os.getpid(), "grpo_patches": grpo_patches.__file__,
            "pluggy": origin("pluggy"), "torch": origin("torch"), "wrapt": origin("wrapt")}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    site = make_site(root / "site")
    built = startup_path.build(root / "startup")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/
    saved, cwd = dict(os.environ), os.getcwd()
    os.chdir(root)  # Ray puts the driver's working directory on the workers' path: not this checkout
    os.environ.update(startup_path.environment(built, "fakefw", environ={"PYTHONPATH": str(site)}))
    # address="local": a cluster of this test's own, never another one running on the host
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": dict(os.environ)})  # what nemo_rl.distributed.virtual_cluster.init_ray does
    try:
        yield built
    finally:
        ray.shutdown()
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved)


def test_actors_in_a_venv_without_grpo_patches_are_patched(cluster):
    @ray.remote(num_cpus=0)
    class Worker:
        def report(self) -> dict:
            return _report()

    @ray.remote(num_cpus=0)
    class Initializer:
        """NeMo-RL's worker initializer: only PYTHONPATH of its own; it creates the worker."""

        def create(self, runtime_env: dict) -> dict:
            return ray.get(Worker.options(runtime_env=runtime_env).remote().report.remote())

    worker_env = {"py_executable": WORKER_PYTHON, "env_vars": dict(os.environ)}
    direct = ray.get(Worker.options(runtime_env=worker_env).remote().report.remote())
    initializer = Initializer.options(runtime_env={"py_executable": WORKER_PYTHON,
                                                   "env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}}).remote()
    created = ray.get(initializer.create.remote(worker_env))
    lib = str(cluster / startup_path.LIB)
    for report in (direct, created):
        assert report["executable"] == WORKER_PYTHON and report["pid"] != os.getpid()
        assert list(report["result"]) == ["patched", 20, None] and report["patched"] is True
        assert report["process"] == f"pid {report['pid']} ({WORKER_PYTHON})"  # status() says which process
        assert report["grpo_patches"].startswith(lib) and report["pluggy"].startswith(lib)
        assert report["torch"] is None and not report["wrapt"].startswith(lib)  # the worker's own packages only


def test_without_the_directory_the_actor_is_not_patched(cluster):
    @ray.remote(num_cpus=0)
    def probe() -> bool:
        import importlib.util

        return importlib.util.find_spec("grpo_patches") is not None

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    assert ray.get(probe.options(runtime_env={"py_executable": WORKER_PYTHON, "env_vars": {**env, "PYTHONPATH": ""}})
                   .remote()) is False
