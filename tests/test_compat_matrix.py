"""The compat matrix and the adapters' supported ranges must not disagree.

Every tested version is inside its adapter's range; the range's lower bound is itself
tested; every patch record exists for at least one tested version (no record ships
untested); every matrix test file exists; the generated results cover every cell.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from grpo_patches import registry

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "compat"))
import matrix  # noqa: E402
import report  # noqa: E402

CELLS = matrix.load()
FRAMEWORKS = sorted({c.framework for c in CELLS})
def _versions(framework: str) -> list[Version]:
    """The versions the adapter sees in the tested cells (a source's ``reads_as`` where set)."""
    return [Version(c.adapter_version) for c in CELLS if c.framework == framework]


def test_every_builtin_framework_has_cells():
    assert set(FRAMEWORKS) <= set(registry.BUILTIN)
    assert "trl" in FRAMEWORKS


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_tested_versions_lie_in_the_supported_range_and_cover_its_lower_bound(framework):
    adapter = registry.get(framework)
    supported = SpecifierSet(adapter.supported)
    versions = _versions(framework)
    for version in versions:
        assert supported.contains(version, prereleases=True), f"{framework} {version} tested but outside {supported}"
    lower = [Version(s.version) for s in supported if s.operator in (">=", "==", "~=")]
    assert lower and min(lower) in versions, f"{framework}: the lowest supported version {min(lower)} is not tested"


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_patch_record_exists_for_a_tested_version(framework):
    adapter = registry.get(framework)
    versions = _versions(framework)
    for record in adapter.patches:
        assert any(record.applies_to(v) for v in versions), f"{record.name} ({record.versions}) is never tested"


def test_every_listed_test_file_exists():
    for cell in CELLS:
        for tier in cell.tiers:
            assert cell.tests_for(tier), f"{cell.name}: no tests for its {tier} tier"
            for path in cell.tests_for(tier):
                assert (ROOT / path).is_file(), f"{cell.name}: {path} does not exist"


def test_the_generated_results_have_a_row_per_cell():
    results = json.loads(report.JSON_OUT.read_text()) if report.JSON_OUT.exists() else {}
    table = report.render(results)
    for cell in CELLS:
        for tier in cell.tiers:
            assert f"| {cell.framework} | {cell.version} | {tier} |" in table
    if report.MD_OUT.exists():  # the committed table is what the generator writes from results.json
        assert report.MD_OUT.read_text() == table


def test_the_report_reads_counts_reasons_and_exactness_from_junit(tmp_path):
    xml = tmp_path / "cell.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_ok"><properties>'
        '<property name="exact_grad_rel" value="3e-8"/><property name="note" value="x"/></properties></testcase>'
        '<testcase classname="tests.test_a" name="test_ok2"><properties>'
        '<property name="exact_grad_rel" value="5e-8"/></properties></testcase>'
        '<testcase classname="tests.test_b" name="test_bad"><failure message="assert 0.2 &lt;= 1e-06">tb</failure>'
        '</testcase><testcase classname="tests.test_b" name="test_skip">'
        '<skipped message="TRL 0.20.0 has no loss_type=\'dapo\'"/></testcase></testsuite></testsuites>'
    )
    parsed = report.parse_junit(xml)
    assert (parsed["passed"], parsed["failed"], parsed["skipped"]) == (2, 1, 1)
    assert parsed["exactness"] == {"exact_grad_rel": 5e-8}
    assert any("FAILED test_b::test_bad: assert 0.2 <= 1e-06" in r for r in parsed["reasons"])
    assert any("no loss_type='dapo'" in r for r in parsed["reasons"])


def test_cells_that_need_a_source_checkout_stay_out_of_ci():
    """CI starts from a clean checkout with no framework clone: a cell that needs one (NeMo-RL)
    would only ever skip there, so it must not be a CI cell (compat/README.md says what CI runs instead)."""
    assert any(cell.source_env for cell in CELLS)
    for cell in CELLS:
        if cell.source_env:
            assert not cell.ci, f"{cell.name} needs {cell.source_env}; CI has no checkout"
            assert cell.missing_source() is None or cell.missing_source().startswith("not run: no source")


def test_compat_help_lists_the_sessions_and_tags_nox_registers():
    """``bash scripts/run compat --help`` reads the matrix alone (no venv): it must say what the
    noxfile really registers."""
    pytest.importorskip("nox")
    import importlib.util

    from nox import registry as nox_registry

    spec = importlib.util.spec_from_file_location("compat_noxfile_for_help", ROOT / "compat" / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    registered = {name: set(func.tags) for name, func in nox_registry.get().items()}
    assert {name: set(tags) for name, tags, _ in matrix.sessions()} == registered
    text = matrix.usage()
    assert all(name in text for name in registered) and "TAG (default ci)" in text


def test_compat_help_and_list_change_nothing(tmp_path):
    import subprocess

    before = (ROOT / "compat" / "RESULTS.md").read_bytes()
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "run"), "compat", "--help"], capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable,
                                                      "GRPO_PATCHES_VENV": str(tmp_path / "no-venv")})
    assert proc.returncode == 0, proc.stderr
    assert "cpu-verl-0.9.1" in proc.stdout and "ray-startup" in proc.stdout
    assert not (tmp_path / "no-venv").exists()  # no venv made for --help
    assert (ROOT / "compat" / "RESULTS.md").read_bytes() == before
