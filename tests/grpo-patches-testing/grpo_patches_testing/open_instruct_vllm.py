"""A test-only stand-in for the ``vllm`` import, so that open-instruct's learner modules import
on a CPU machine (tests and benchmarks only; never installed by grpo_patches itself).

open-instruct imports vLLM at module level (``grpo_fast.py``, ``vllm_utils.py``,
``data_loader.py``, ``grpo_olmo_core_actor.py``), but the learner never calls it: vLLM runs in
its own engine actors. vLLM cannot live beside torch 2.13 here (it pins its own torch and CUDA),
so :func:`installed` puts a meta-path finder first on ``sys.meta_path`` that answers every
``vllm`` / ``vllm.*`` import with a package whose every attribute is a :class:`Dummy` class.
Leaving the context removes the finder and the dummy modules (modules that imported names from
them keep those names). ``vllm_utils.py`` rewrites ``MambaSpec.__dataclass_fields__["dtypes"].type``
at import time, so a dummy class answers any ``__dataclass_fields__`` key.

Calling a dummy (as code that really *uses* vLLM would) raises, naming the attribute, so a test
that reaches vLLM fails loudly instead of running on a stand-in by accident.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

ROOT = "vllm"


class _DummyMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _dummy(f"{cls.__qualname__}.{name}")
        setattr(cls, name, value)  # one dummy per name
        return value

    def __getitem__(cls, item: Any) -> Any:  # vllm.Foo[...] in an annotation
        return cls

    def __or__(cls, other: Any) -> Any:  # vllm.Foo | None in an annotation
        return cls

    __ror__ = __or__


class Dummy(metaclass=_DummyMeta):
    """What every ``vllm`` name is here: annotations and class-level look-ups work, use raises."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"vllm.{type(self).__qualname__} was used, but vllm is a test-only stand-in here "
                           "(grpo_patches_testing.open_instruct_vllm): this code path needs the real vLLM")


def _dummy(qualname: str) -> type:
    cls = _DummyMeta(qualname.rsplit(".", 1)[-1], (Dummy,), {
        "__qualname__": qualname,
        "__module__": ROOT,
        "__dataclass_fields__": defaultdict(lambda: types.SimpleNamespace(type=None)),
        "__annotations__": {},
    })
    return cls


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _dummy(name)
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != ROOT and not fullname.startswith(ROOT + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+grpo-patches-stand-in"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


_FINDER = _Finder()


def install() -> None:
    """Put the stand-in first on ``sys.meta_path`` (idempotent); see :func:`installed` to undo it."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall() -> None:
    """Remove the finder and every ``vllm`` module it made."""
    with contextlib.suppress(ValueError):
        sys.meta_path.remove(_FINDER)
    for name in [n for n, m in sys.modules.items() if isinstance(m, _Module)]:
        del sys.modules[name]


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """The stand-in for the block's imports; removed after (a real ``vllm`` then imports as usual)."""
    already = _FINDER in sys.meta_path
    install()
    try:
        yield
    finally:
        if not already:
            uninstall()
