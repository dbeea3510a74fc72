"""``GRPO_PATCHES=open_instruct`` reaches open-instruct's learner actors.

``grpo_fast.PolicyTrainerRayProcess`` is ``@ray.remote``: Ray ships the class to its actor by value
(the module attribute is the ``ActorClass``, so cloudpickle cannot name the class), so a patch of one of
its methods in the driver would never reach the actor. The adapter's records stand on names the actor
looks up in its own imports; its learner registers itself through ``RayProcess.__init__`` (the base
class, pickled by reference). Here a real local Ray cluster (logical GPUs: the class asks for one)
gets the driver's environment as ``grpo_fast.main`` hands it over (``ray.init(runtime_env={"env_vars":
os.environ})``), with the start-up directory of ``grpo-patches run`` on ``PYTHONPATH``; the actor made
from the real class reports, from its own process, that it is patched and that its learner registered.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from grpo_patches import startup_path
from grpo_patches_testing import open_instruct_cpu as harness
from grpo_patches_testing.open_instruct_startup import cpu_run

ray = pytest.importorskip("ray", reason="not run: needs ray (open-instruct's cells have it)")
grpo_fast = harness.load()


def _report(learner) -> dict:
    """Runs inside the actor (``__ray_call__``): what grpo_patches says there."""
    import grpo_patches
    from grpo_patches.adapters.open_instruct.state import LEARNERS

    entry = grpo_patches.status()["open_instruct"]
    return {"patched": entry["patched"], "process": entry["process"], "pid": os.getpid(),
            "registered": learner in LEARNERS, "targets": entry.get("targets", [])}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray")
    built = startup_path.build(root / "startup")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import tests/
    cpu_run.pickle_module_subclasses_by_reference()  # the driver ships the learner class by value (torch 2.13)
    saved, cwd = dict(os.environ), os.getcwd()
    kit = Path(harness.__file__).parent / "open_instruct_startup"  # the vLLM import stand-in, test-only
    os.chdir(root)
    os.environ.update(startup_path.environment(built, "open_instruct", environ={
        "PYTHONPATH": os.pathsep.join([str(kit), os.environ.get("PYTHONPATH", "")])}))
    os.environ["GRPO_PATCHES_OPEN_INSTRUCT_CPU"] = "1"
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": dict(os.environ)})  # what grpo_fast.main does
    try:
        yield
    finally:
        ray.shutdown()
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved)


def test_the_learner_actor_is_patched_in_its_own_process(cluster):
    args = SimpleNamespace(num_mini_batches=2, sequence_parallel_size=1)
    actor = grpo_fast.PolicyTrainerRayProcess.remote(1, 0, 0, "127.0.0.1", harness.free_port(), args,
                                                     SimpleNamespace(), SimpleNamespace(),
                                                     SimpleNamespace(pad_token_id=0))
    report = ray.get(actor.__ray_call__.remote(_report), timeout=600)
    assert report["pid"] != os.getpid()
    assert report["patched"] and report["registered"], report
    assert "open_instruct.grpo_utils:forward_for_logprobs" in report["targets"]
