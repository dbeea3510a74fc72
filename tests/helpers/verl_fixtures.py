"""The verl tests' module-scoped set-up (:func:`grpo_patches_testing.verl_engine_runs.setup_process`)."""

from __future__ import annotations

import pytest

from grpo_patches_testing.verl_engine_runs import setup_process


@pytest.fixture(scope="module", autouse=True)
def process_group() -> None:
    """Autouse in the modules that import it: the gloo group (legacy) or the engine's setup, once per module."""
    setup_process()


@pytest.fixture(autouse=True)
def fresh_verify_records():
    """Autouse in the modules that import it: verify mode's records start and end empty per test."""
    from grpo_patches import verify_log

    verify_log.reset()
    yield
    verify_log.reset()
