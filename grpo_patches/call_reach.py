"""Does a class's method (transitively) call another of its methods? Read from the bytecode.

An adapter that splits work between two methods of a framework's class (e.g. defers a pass from
one to a later one) is exact only if the class's driver really calls the later method. A
subclass that overrides the driver (a recipe's own ``fit``) may call it through helpers
(``fit -> fit_step -> _fit_update_actor -> _update_actor``) or never. :func:`reaches` follows the
attribute names each method's code reads (``self.x`` reads ``x``) through the methods the class
resolves them to, and through ``super()`` to the next definition in the MRO.

It answers "may call" (a name read in a branch that never runs still counts), so it proves only
the negative: ``False`` means no path exists and the split would leave work undone. Callers keep
a run-time check for the rest.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Iterator


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # nested functions, lambdas, comprehensions
            yield from _code_objects(const)


def _function(value: object) -> types.FunctionType | None:
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    try:
        value = inspect.unwrap(value)  # wrapt proxies and functools.wraps expose __wrapped__
    except ValueError:
        return None
    return value if isinstance(value, types.FunctionType) else None


def _definition(klass: type, name: str, after: type | None = None) -> tuple[type, types.FunctionType] | None:
    """The class defining ``name`` for ``klass`` (after ``after`` in the MRO, for ``super()``) and its function."""
    mro = klass.__mro__
    if after is not None:
        mro = mro[mro.index(after) + 1:] if after in mro else ()
    for owner in mro:
        if name in vars(owner):
            function = _function(vars(owner)[name])
            return (owner, function) if function is not None else None
    return None


@functools.lru_cache(maxsize=256)
def reaches(klass: type, start: str, target: str) -> bool:
    """Whether ``klass.<start>`` may call ``target`` on the same object, directly or through other
    methods of ``klass`` (module docstring). ``True`` when ``start`` is ``target``."""
    first = _definition(klass, start)
    if first is None:
        return False
    seen: set[tuple[type, str]] = set()
    todo = [(first, start)]
    while todo:
        (owner, function), name = todo.pop()
        if (owner, name) in seen:
            continue
        seen.add((owner, name))
        if name == target:
            return True
        for code in _code_objects(function.__code__):
            for read in code.co_names:
                if read == target:
                    return True
                found = _definition(klass, read)
                if found is not None:
                    todo.append((found, read))
            if "super" in code.co_names:
                parent = _definition(klass, name, after=owner)
                if parent is not None:
                    todo.append((parent, name))
    return False
