"""grpo_patches.call_reach: which methods a class's driver may call, read from the bytecode."""

from __future__ import annotations

import functools

import wrapt

from grpo_patches.call_reach import reaches


class Base:
    def fit(self):
        for _ in range(2):
            self._step()

    def _step(self):
        self.update()

    def update(self):
        pass


class CallsWorkersItself(Base):
    def fit(self):
        self.workers.run()


class CallsSuper(Base):
    def fit(self):
        return super().fit()


class ThroughALambda(Base):
    def fit(self):
        steps = [lambda: self.update()]
        steps[0]()


def _logged(function):
    @functools.wraps(function)
    def inner(*args, **kwargs):
        return function(*args, **kwargs)
    return inner


class Decorated(Base):
    @_logged
    def fit(self):
        self._step()


def test_reaches_through_helpers_super_lambdas_and_decorators():
    assert reaches(Base, "fit", "update")
    assert reaches(CallsSuper, "fit", "update")
    assert reaches(ThroughALambda, "fit", "update")
    assert reaches(Decorated, "fit", "update")


def test_a_driver_without_a_path_does_not_reach():
    assert not reaches(CallsWorkersItself, "fit", "update")
    assert not reaches(Base, "update", "fit")
    assert not reaches(Base, "missing", "update")


def test_a_wrapt_patched_method_is_read_through_its_wrapper():
    class Patched(Base):
        pass

    Patched.fit = wrapt.FunctionWrapper(CallsWorkersItself.__dict__["fit"], lambda w, i, a, k: w(*a, **k))
    assert not reaches(Patched, "fit", "update")
    Patched._step = wrapt.FunctionWrapper(Base.__dict__["_step"], lambda w, i, a, k: w(*a, **k))
    assert reaches(Patched, "_step", "update")
