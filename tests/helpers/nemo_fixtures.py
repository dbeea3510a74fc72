"""Fixtures for the NeMo-RL adapter's tests on the stand-in (:mod:`tests.helpers.nemo_fake`).

``fake_nemo(tag)`` puts that tag's stand-in first on ``sys.path`` and returns a namespace of
helpers; afterwards the patches are undone and every ``nemo_rl`` module is forgotten, so the
next test can load another tag.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any, Callable

import pytest

import grpo_patches
from grpo_patches import savings
from tests.helpers import nemo_fake


def _forget_nemo() -> None:
    for name in [m for m in sys.modules if m == "nemo_rl" or m.startswith("nemo_rl.")]:
        del sys.modules[name]


@pytest.fixture
def fake_nemo(tmp_path_factory) -> Callable[[str], Any]:
    roots: list[str] = []

    def load(tag: str) -> Any:
        assert not roots, "one tag per test"
        root = str(nemo_fake.make_source(tmp_path_factory.mktemp(f"nemo-{tag}"), tag))
        sys.path.insert(0, root)
        roots.append(root)
        importlib.invalidate_caches()
        return types.SimpleNamespace(tag=tag, root=root)

    _forget_nemo()
    savings.reset()
    yield load
    grpo_patches.disable()
    savings.reset()
    _forget_nemo()
    for root in roots:
        sys.path.remove(root)
