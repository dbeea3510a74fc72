"""Verify mode's framework-free core: options, schedule, tolerances, comparisons, verdicts.

The per-framework tests (a plugin that drops a non-zero row caught on the first verify step,
``"disable"`` finishing with the unpatched weights) live with each adapter's tests.
"""

from __future__ import annotations

import math
import os
import random
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import grpo_patches
from grpo_patches import verify, verify_gradients, verify_log
from grpo_patches.errors import ExactnessError, GrpoPatchesWarning, OptionError
from grpo_patches.options import Options, parse_env_options
from tests.helpers.fakefw_site import make_site


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    return make_site(tmp_path_factory.mktemp("site"))


@pytest.fixture
def fakefw(site, monkeypatch):
    """The fake framework (with its adapter) importable, nothing enabled afterwards."""
    monkeypatch.syspath_prepend(str(site))
    yield
    grpo_patches.disable()
    verify_log.reset()
    for name in [m for m in sys.modules if m.startswith("fakefw")]:
        del sys.modules[name]


# -- options -----------------------------------------------------------------------------


def test_verify_options_default_off_and_validate():
    assert Options().verify_every is None and Options().verify_action == "raise" and Options().verify_tolerance is None
    assert Options.from_kwargs({"verify_every": 3, "verify_action": "disable", "verify_tolerance": 1}).verify_tolerance == 1.0
    for bad, match in [({"verify_every": 0}, "verify_every"), ({"verify_every": True}, "verify_every"),
                       ({"verify_every": 1.5}, "verify_every"), ({"verify_action": "warn"}, "'raise', 'disable'"),
                       ({"verify_tolerance": 0}, "verify_tolerance"), ({"verify_tolerance": float("nan")}, "verify_tolerance"),
                       ({"verify_tolerance": float("inf")}, "verify_tolerance"), ({"verify_tolerance": "1e-3"}, "verify_tolerance")]:
        with pytest.raises(OptionError, match=match):
            Options.from_kwargs(bad)


def test_verify_options_parse_from_the_environment_variable():
    assert parse_env_options("verify_every=5,verify_action=disable,verify_tolerance=1e-4") == {
        "verify_every": 5, "verify_action": "disable", "verify_tolerance": 1e-4}
    assert parse_env_options("verify_every=none,verify_tolerance=none") == {"verify_every": None, "verify_tolerance": None}
    for text in ("verify_every=often", "verify_tolerance=tight", "verify_action=warn", "verify_every=0"):
        with pytest.raises(OptionError):
            parse_env_options(text)


# -- schedule and tolerance ----------------------------------------------------------------


def test_due_verifies_the_first_step_and_every_nth_after_it(fakefw):
    assert not any(verify.due("fakefw", s) for s in range(5))  # not enabled
    grpo_patches.enable("fakefw")
    assert not any(verify.due("fakefw", s) for s in range(5))  # off by default
    grpo_patches.enable("fakefw", verify_every=3)
    assert [s for s in range(10) if verify.due("fakefw", s)] == [0, 3, 6, 9]
    grpo_patches.enable("fakefw", verify_every=1)
    assert all(verify.due("fakefw", s) for s in range(4))


def test_verify_every_for_an_adapter_without_verify_mode_is_an_error_never_a_silent_no_op(fakefw, monkeypatch):
    from grpo_patches import registry
    from grpo_patches.errors import UnsupportedFrameworkError
    from packaging.version import Version

    adapter = registry.get("fakefw")
    bare = type(adapter)(name="fakefw", distribution="fakefw", supported=adapter.supported,
                         patches=[t for t in adapter.patches if t.option != "verify_every"])
    with pytest.raises(UnsupportedFrameworkError, match="verify_every=2 asks for verify mode.*verify_every=None"):
        bare.select(Version("1.0"), Options(verify_every=2))
    targets, notes = bare.select(Version("1.0"), Options(verify_every=2), strict=False)  # enable("all", ...)
    assert notes["verify_every"].startswith("off: verify mode is not available for fakefw")
    assert bare.select(Version("1.0"), Options())[1] == {}  # off by default: nothing said
    assert "verify_every" not in adapter.select(Version("1.0"), Options(verify_every=2))[1]  # it has verify records
    for name in ("nemo_rl",):  # until its verify mode exists (verl's covers every supported version)
        real = registry.get(name)
        version = Version(real.supported.split(",")[0].lstrip(">="))
        with pytest.raises(UnsupportedFrameworkError, match=f"not available for {name}"):
            real.select(version, Options(verify_every=1))


def test_tolerance_fp32_fixed_half_from_the_noise_floor_user_value_wins(fakefw):
    grpo_patches.enable("fakefw", verify_every=1)
    assert verify.tolerance("fakefw", torch.float32) == verify.FP32_TOLERANCE == 1e-5
    assert verify.tolerance("fakefw", torch.float64, noise_floor=1.0) == 1e-5
    assert verify.tolerance("fakefw", torch.bfloat16, noise_floor=1e-3) == pytest.approx(1e-2)
    assert verify.tolerance("fakefw", "float16", noise_floor=1e-3) == pytest.approx(1e-2)
    # a re-batched repeat that happened to be bitwise equal does not make the tolerance 0
    assert verify.tolerance("fakefw", torch.bfloat16, noise_floor=0.0) == pytest.approx(10 * 0.1 * 2 ** -7)
    assert verify.tolerance("fakefw", torch.bfloat16) == pytest.approx(10 * 2 ** -7)  # no floor measured
    grpo_patches.enable("fakefw", verify_every=1, verify_tolerance=3e-4)
    assert verify.tolerance("fakefw", torch.bfloat16, noise_floor=1e-3) == 3e-4
    assert verify.tolerance("fakefw", torch.float32) == 3e-4


# -- comparisons -----------------------------------------------------------------------------


def test_rel_l2_over_parameter_lists():
    a = [torch.tensor([3.0, 0.0]), None, torch.tensor([4.0])]
    assert verify.rel_l2(a, a) == 0.0
    b = [torch.tensor([3.0, 0.0]), None, torch.tensor([4.0 + 5e-3])]
    assert verify.rel_l2(b, a) == pytest.approx(1e-3, rel=1e-4)  # fp32 inputs
    assert verify.rel_l2([None, None, torch.tensor([4.0])], a) == pytest.approx(3 / 5)  # a missing gradient counts as 0
    assert verify.rel_l2([torch.zeros(2)], [torch.zeros(2)]) == 0.0
    assert verify.rel_l2([torch.ones(2)], [torch.zeros(2)]) == math.inf
    assert verify.rel_l2([torch.tensor([float("nan")])], [torch.ones(1)]) == math.inf
    with pytest.raises(ValueError, match="2 tensors against 1"):
        verify.rel_l2(a[:2], a[:1])


def test_max_abs_diff_masks_and_flags_non_finite_values():
    ref = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]])
    used = ref + torch.tensor([[0.0, 1e-3], [7.0, 0.0]])
    assert verify.max_abs_diff(used, ref) == pytest.approx(7.0)
    assert verify.max_abs_diff(used, ref, mask=torch.tensor([[1, 1], [0, 1]])) == pytest.approx(1e-3, rel=1e-4)
    assert verify.max_abs_diff(used, ref, mask=torch.zeros(2, 2)) == 0.0
    placeholder = torch.full_like(ref, float("nan"))  # a skipped pass's placeholder reaching the loss
    assert verify.max_abs_diff(placeholder, ref) == math.inf


def test_preserved_rng_leaves_the_next_draws_unchanged():
    import numpy

    def draws():
        return torch.rand(3).tolist(), random.random(), float(numpy.random.rand())

    torch.manual_seed(1), random.seed(1), numpy.random.seed(1)
    expected = draws()
    torch.manual_seed(1), random.seed(1), numpy.random.seed(1)
    with verify.preserved_rng():
        draws(), torch.nn.functional.dropout(torch.ones(8), 0.5)  # the extra computation consumes random numbers
    assert draws() == expected


def test_rng_state_is_put_back_by_set_rng_state():
    import numpy

    def draws():
        return torch.rand(2).tolist(), random.random(), float(numpy.random.rand())

    state = verify.rng_state()
    first = draws()
    verify.set_rng_state(state)
    assert draws() == first
    verify.set_rng_state(state)  # reusable: the patched and the unpatched computation start alike
    assert draws() == first


def test_match_rows_finds_rows_by_content():
    ids = torch.tensor([[5, 6, 7], [1, 2, 3], [5, 6, 7], [8, 8, 8]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]])
    picked = [3, 1, 0]  # a shuffled micro-batch of rows 3, 1 and one of the equal rows 0 / 2
    found = verify.match_rows([ids[picked], mask[picked]], [ids, mask])
    assert found == [[3], [1], [0, 2]]
    other_mask = mask[picked].clone()
    other_mask[0, 1] = 1  # same ids, another mask: another row, not found
    assert verify.match_rows([ids[picked], other_mask], [ids, mask])[0] == []
    assert verify.match_rows([ids[:, :2]], [ids]) == [[]] * 4  # another width: nothing matches
    with pytest.raises(ValueError, match="1 tensors against 2"):
        verify.match_rows([ids], [ids, mask])


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


def test_grads_of_leaves_dot_grad_alone_and_as_loss_accumulates_exactly_the_chosen_gradient():
    model, x = _model(), torch.randn(5, 4)
    params = list(model.parameters())
    loss = model(x).pow(2).mean()
    grads = verify.grads_of(loss, params, retain_graph=True)
    assert all(p.grad is None for p in params)
    loss.backward()
    expected = [p.grad.clone() for p in params]
    assert verify.rel_l2(grads, expected) == 0.0

    model.zero_grad(set_to_none=True)
    chosen = [g * 3 for g in grads]  # a different gradient than the loss's own
    surrogate = verify.as_loss(torch.tensor(0.25), params, chosen)
    assert surrogate.item() == 0.25
    surrogate.backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(params, chosen))
    model.zero_grad(set_to_none=True)
    params[0].grad = torch.ones_like(params[0])  # accumulates on top, as a micro-batch's backward does
    verify.as_loss(torch.tensor(1.0), params, chosen).backward()
    assert torch.equal(params[0].grad, 1 + chosen[0])


def test_grads_of_an_unused_parameter_is_none():
    used, unused = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    frozen = torch.ones(2)
    assert verify.grads_of((used * 2).sum(), [used, unused, frozen])[1:] == [None, None]


# -- verdicts ------------------------------------------------------------------------------


def test_check_within_tolerance_returns_the_metric_and_records_it(fakefw):
    grpo_patches.enable("fakefw", verify_every=1)
    verdict = verify.check("fakefw", ["zero_advantage_filter"], 0, "grad_rel_diff", 2e-7, 1e-5)
    assert verdict.ok and verdict.metrics == {"grpo_patches/verify/grad_rel_diff": 2e-7}
    verify.check("fakefw", ["logprob_skip"], 0, "old_logprob_max_abs_diff", 0.0, 1e-5)
    verify.check("fakefw", ["zero_advantage_filter"], 4, "grad_rel_diff", 1e-7, 1e-5)
    report = grpo_patches.status()["fakefw"]["verify"]
    assert report == {"steps_verified": 2, "checks": 3, "failures": [],
                      "last": {"grad_rel_diff": 1e-7, "old_logprob_max_abs_diff": 0.0},
                      "worst": {"grad_rel_diff": 2e-7, "old_logprob_max_abs_diff": 0.0}}


def test_check_above_tolerance_raises_naming_framework_optimization_step_and_figures(fakefw):
    grpo_patches.enable("fakefw", verify_every=1)
    with pytest.raises(ExactnessError) as caught:
        verify.check("fakefw", ["zero_advantage_filter", "tiled_loss"], 3, "grad_rel_diff", 0.25, 1e-5,
                     detail="a plugin dropped a row")
    err = caught.value
    assert (err.framework, err.optimizations, err.step, err.measured, err.tolerance) == (
        "fakefw", ("zero_advantage_filter", "tiled_loss"), 3, 0.25, 1e-5)
    text = str(err)
    for part in ("fakefw step 3", "zero_advantage_filter, tiled_loss", "grad_rel_diff = 2.500e-01", "1.000e-05",
                 "a plugin dropped a row", "verify_action='disable'"):
        assert part in text
    assert grpo_patches.ExactnessError is ExactnessError
    assert grpo_patches.status()["fakefw"]["verify"]["failures"] == [
        "step 3: zero_advantage_filter, tiled_loss: grad_rel_diff = 2.500e-01 > 1.000e-05"]
    assert grpo_patches.api.active_options("fakefw").tiled_loss is False  # enabled with its default, untouched


def test_a_non_finite_figure_is_a_mismatch(fakefw):
    grpo_patches.enable("fakefw", verify_every=1)
    with pytest.raises(ExactnessError, match="inf"):
        verify.check("fakefw", ["logprob_skip"], 0, "old_logprob_max_abs_diff", float("nan"), 1e-5)


def test_disable_switches_the_optimization_off_for_the_rest_of_the_run(fakefw):
    grpo_patches.enable("fakefw", verify_every=1, verify_action="disable", tiled_loss=True, tile_size=4)
    with pytest.warns(GrpoPatchesWarning, match="tiled_loss switched off by verification at step 2"):
        verdict = verify.check("fakefw", ["tiled_loss"], 2, "grad_rel_diff", 1e-2, 1e-5)
    assert not verdict.ok and verdict.metrics == {"grpo_patches/verify/grad_rel_diff": 1e-2}
    options = grpo_patches.api.active_options("fakefw")
    assert options.tiled_loss is False and options.tile_size == 4 and options.recompute is True
    entry = grpo_patches.status()["fakefw"]
    assert entry["options"]["tiled_loss"] is True  # what the user asked for
    assert entry["switched_off"] == {"tiled_loss": entry["notes"]["tiled_loss"][len("off: "):]}
    assert "grad_rel_diff = 1.000e-02 > tolerance 1.000e-05" in entry["notes"]["tiled_loss"]
    grpo_patches.enable("fakefw", verify_every=1, verify_action="disable", tiled_loss=True, tile_size=4)
    assert grpo_patches.api.active_options("fakefw").tiled_loss is False  # the same enable again: still off
    grpo_patches.enable("fakefw", tiled_loss=True, tile_size=4)  # other options: a fresh start
    assert grpo_patches.api.active_options("fakefw").tiled_loss is True


def test_switch_off_rejects_a_name_that_is_no_optimization(fakefw):
    grpo_patches.enable("fakefw")
    with pytest.raises(ValueError, match="tile_size"):
        grpo_patches.api.switch_off("fakefw", "tile_size", "why")


# -- ranks agree ------------------------------------------------------------------------------


def _agree_worker(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        figures = [{"a": 1e-7, "b": 0.5, "c": 1.0}, {"a": 3e-7, "b": float("nan"), "c": float("inf")}][rank]
        agreed = verify.agree(figures)
        torch.save(agreed, os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_the_largest_figure(tmp_path):
    mp.spawn(_agree_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    results = [torch.load(tmp_path / f"{rank}.pt") for rank in range(2)]
    assert results[0] == results[1] == {"a": 3e-7, "b": math.inf, "c": math.inf}


def test_agree_without_distributed_returns_the_figures():
    assert verify.agree({"a": 1.0, "b": float("nan")}) == {"a": 1.0, "b": math.inf}


# -- the gradient comparison of one micro-batch -------------------------------------------------


def _losses(scale: float = 1.0):
    """(params, loss closures): the unpatched loss, a patched one off by ``scale``, a repeat."""
    model, x = _model(), torch.randn(6, 4)
    params = list(model.parameters())

    def loss(rows=None, factor=1.0):
        return factor * model(x if rows is None else x[rows]).pow(2).sum() / 6

    return params, (lambda: loss(factor=scale)), loss, (lambda: loss(rows=torch.arange(5, -1, -1)))


def test_compare_gradients_keeps_the_patched_gradient_within_tolerance(fakefw):
    grpo_patches.enable("fakefw", verify_every=1)
    params, patched, unpatched, repeat = _losses()
    reference = verify.grads_of(unpatched(), params)
    result = verify_gradients.compare_gradients("fakefw", ["tiled_loss"], 0, params, patched, unpatched, repeat,
                                                torch.float32)
    assert result.patched and result.verdict.ok and result.noise_floor is None  # fp32: no repeat
    assert result.verdict.metrics == {"grpo_patches/verify/grad_rel_diff": 0.0}
    assert all(p.grad is None for p in params)  # nothing accumulated until the framework's backward
    result.loss.backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(params, reference))


def test_compare_gradients_raises_or_uses_the_unpatched_gradient(fakefw):
    grpo_patches.enable("fakefw", verify_every=1)
    params, patched, unpatched, repeat = _losses(scale=1.01)
    with pytest.raises(ExactnessError, match="grad_rel_diff = 1.000e-02"):
        verify_gradients.compare_gradients("fakefw", ["tiled_loss"], 7, params, patched, unpatched)
    grpo_patches.enable("fakefw", verify_every=1, verify_action="disable")
    reference = verify.grads_of(unpatched(), params)
    with pytest.warns(GrpoPatchesWarning, match="tiled_loss switched off by verification at step 7"):
        result = verify_gradients.compare_gradients("fakefw", ["tiled_loss"], 7, params, patched, unpatched)
    assert not result.patched and result.loss.item() == pytest.approx(unpatched().item())
    assert result.verdict.reason.startswith("switched off by verification at step 7: grad_rel_diff")
    result.loss.backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(params, reference))


def test_compare_gradients_in_half_precision_measures_the_noise_floor(fakefw):
    grpo_patches.enable("fakefw", verify_every=1)
    params, patched, unpatched, repeat = _losses()
    calls = []

    def counted_repeat():
        calls.append(1)
        return repeat()

    result = verify_gradients.compare_gradients("fakefw", ["tiled_loss"], 0, params, patched, unpatched,
                                                counted_repeat, torch.bfloat16)
    assert calls == [1] and result.noise_floor is not None and result.noise_floor < 1e-5  # fp32 math here
    assert result.verdict.tolerance == pytest.approx(verify.tolerance("fakefw", torch.bfloat16, result.noise_floor))


def test_against_an_fp32_reference_a_more_accurate_patched_gradient_passes(fakefw):
    """Half precision with a reference: ``grad_rel_diff`` is the patched gradient's distance from
    it, the floor the unpatched one's; a patched result nearer the reference than upstream passes
    however far it is from upstream, one over twice upstream's distance fails."""
    grpo_patches.enable("fakefw", verify_every=1)
    params, exact, _, _ = _losses()
    upstream, near = (lambda: exact() * 1.05), (lambda: exact() * 1.01)  # upstream "rounds" 5 %
    result = verify_gradients.compare_gradients("fakefw", ["tiled_loss"], 0, params, near, upstream,
                                                dtype=torch.bfloat16, reference=exact)
    assert result.patched and result.noise_floor == pytest.approx(0.05, rel=1e-4)
    assert result.verdict.measured == pytest.approx(0.01, rel=1e-4)
    assert result.verdict.tolerance == pytest.approx(verify.REFERENCE_FACTOR * 0.05, rel=1e-4)
    with pytest.raises(ExactnessError, match="grad_rel_diff = 1.200e-01"):
        verify_gradients.compare_gradients("fakefw", ["tiled_loss"], 0, params, lambda: exact() * 1.12, upstream,
                                           dtype=torch.bfloat16, reference=exact)


def test_a_discontinuous_configuration_is_judged_in_fp32(fakefw):
    """``exact``: the verdict is the fp32 pair's (the fp32 tolerance); the half-precision patched
    result is the one used; the unpatched computation runs only on a mismatch."""
    grpo_patches.enable("fakefw", verify_every=1)
    params, exact, _, _ = _losses()
    calls = []

    def unpatched():
        calls.append(1)
        return exact() * 1.3  # a flipped mask: far from the patched half-precision result

    half = lambda: exact() * 0.9  # noqa: E731
    result = verify_gradients.compare_gradients("fakefw", ["tiled_loss"], 0, params, half, unpatched,
                                                dtype=torch.bfloat16, exact=(exact, exact))
    assert result.patched and calls == [] and result.verdict.tolerance == verify.FP32_TOLERANCE
    assert result.loss.item() == pytest.approx(half().item())
    grpo_patches.enable("fakefw", verify_every=1, verify_action="disable")
    with pytest.warns(GrpoPatchesWarning, match="judged in fp32"):
        result = verify_gradients.compare_gradients("fakefw", ["tiled_loss"], 0, params, half, unpatched,
                                                    dtype=torch.bfloat16, exact=(lambda: exact() * 1.001, exact))
    assert not result.patched and calls == [1]
