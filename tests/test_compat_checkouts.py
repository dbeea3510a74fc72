"""Packages a compat cell builds from a user's checkout (``from_checkout`` in compat/matrix.toml).

NeMo-RL's Megatron cells need megatron-core / Megatron-Bridge at commits no PyPI release has; the
matrix names the commit, the variable holding the clone and the paths to export, compat/sources.py
exports them and the noxfile installs them ``--no-deps``. Nothing is fetched from GitHub.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "compat"))
import matrix  # noqa: E402
import sources  # noqa: E402

CELLS = {cell.name: cell for cell in matrix.load()}
BUILT = {name: cell for name, cell in CELLS.items() if cell.from_checkout}
MEGATRON = {name: cell for name, cell in BUILT.items() if cell.name.endswith("-megatron")}
README = (ROOT / "compat" / "README.md").read_text()


def test_the_megatron_cells_build_their_pair_from_checkouts_and_nothing_comes_from_github():
    assert set(MEGATRON) == {"nemo_rl-v0.6.0-megatron", "nemo_rl-main-megatron"}
    for cell in CELLS.values():
        assert not [r for r in cell.no_deps + cell.install if "git+" in r], f"{cell.name} installs from a git URL"
    for cell in MEGATRON.values():
        assert [c.package for c in cell.from_checkout] == ["megatron-core", "megatron-bridge"]
        assert all(re.fullmatch(r"[0-9a-f]{40}", c.commit) for c in cell.from_checkout)


def test_the_open_instruct_cells_build_olmo_core_from_its_clone_at_the_readmes_commit():
    """ai2-olmo-core is the lock's git revision, never on PyPI: each cell names its commit and OLMO_CORE_SRC."""
    cells = {name: cell for name, cell in BUILT.items() if name.startswith("open_instruct-")}
    assert set(cells) == {"open_instruct-v0.3.0", "open_instruct-main"}
    for cell in cells.values():
        [olmo] = cell.from_checkout
        assert (olmo.package, olmo.source_env) == ("ai2-olmo-core", "OLMO_CORE_SRC")
        assert re.fullmatch(r"[0-9a-f]{40}", olmo.commit)
        assert olmo.commit[:7] in README and " ".join(olmo.paths) in README


@pytest.mark.parametrize("name", sorted(MEGATRON))
def test_the_declared_commits_variables_and_paths_are_the_readmes(name):
    cell = MEGATRON[name]
    row = next(line for line in README.splitlines() if line.startswith(f"| `{cell.version}` |"))
    core, bridge = cell.from_checkout
    assert row.index(bridge.commit[:7]) < row.index(core.commit[:7]), row  # columns: Megatron-Bridge, megatron-core
    assert (core.source_env, bridge.source_env) == ("MEGATRON_LM_SRC", "MEGATRON_BRIDGE_SRC")
    for checkout in cell.from_checkout:
        assert checkout.source_env in README
        assert " ".join(checkout.paths) in README, f"{checkout.package}: the README lists other paths"


def test_a_missing_checkout_variable_skips_the_cell_with_its_name(monkeypatch, tmp_path):
    cell = BUILT["nemo_rl-v0.6.0-megatron"]
    monkeypatch.setenv("NEMO_RL_SRC", str(tmp_path))
    for var in ("MEGATRON_LM_SRC", "MEGATRON_BRIDGE_SRC", cell.venv_env):
        monkeypatch.delenv(var, raising=False)
    assert cell.missing_source() == ("not run: no source (set MEGATRON_LM_SRC to a checkout of megatron-core, "
                                     "or NEMO_RL_MEGATRON_V060_VENV to a ready venv)")
    monkeypatch.setenv("MEGATRON_LM_SRC", str(tmp_path))
    assert "set MEGATRON_BRIDGE_SRC to a checkout of megatron-bridge" in cell.missing_source()
    monkeypatch.setenv("MEGATRON_BRIDGE_SRC", str(tmp_path))
    assert cell.missing_source() is None
    monkeypatch.delenv("MEGATRON_LM_SRC")
    monkeypatch.setenv(cell.venv_env, str(tmp_path))  # a ready venv holds the pair: no checkout needed
    assert cell.missing_source() is None
    monkeypatch.delenv("NEMO_RL_SRC")  # the framework's own source is needed either way
    assert "set NEMO_RL_SRC" in cell.missing_source()


def test_a_version_may_only_name_packages_its_framework_declares(tmp_path):
    toml = tmp_path / "matrix.toml"
    toml.write_text('[fw]\npython = "3.12"\ntests = []\n'
                    'checkouts.pkg = { source_env = "PKG_SRC", export = ["src"] }\n'
                    '[[fw.versions]]\nversion = "1"\nfrom_checkout = { other = "abc" }\n')
    with pytest.raises(ValueError, match=r"from_checkout names \['other'\]"):
        matrix.load(toml)


def test_the_export_holds_only_the_listed_paths_of_the_commit(monkeypatch, tmp_path):
    """compat/sources.py on a small clone: the declared paths at the declared commit, nothing else."""
    clone = tmp_path / "clone"
    git = ["git", "-C", str(clone), "-c", "user.name=t", "-c", "user.email=t@t"]
    clone.mkdir()
    subprocess.run([*git, "init", "-q"], check=True)
    (clone / "src" / "pkg").mkdir(parents=True)
    (clone / "src" / "pkg" / "__init__.py").write_text("VERSION = 1\n")
    (clone / "pyproject.toml").write_text("[project]\nname = 'pkg'\n")
    (clone / "docs").mkdir()
    (clone / "docs" / "big.gif").write_text("not exported")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    (clone / "src" / "pkg" / "__init__.py").write_text("VERSION = 2\n")  # the working tree moved on
    subprocess.run([*git, "commit", "-q", "-am", "two"], check=True)
    toml = tmp_path / "matrix.toml"
    toml.write_text('[fw]\npython = "3.12"\ntests = []\n'
                    'checkouts.pkg = { source_env = "PKG_SRC", export = ["src", "pyproject.toml"] }\n'
                    f'[[fw.versions]]\nversion = "1"\nfrom_checkout = {{ pkg = "{commit}" }}\n')
    (cell,) = matrix.load(toml)
    monkeypatch.setenv("PKG_SRC", str(clone))
    monkeypatch.setattr(sources, "SOURCES", tmp_path / "sources")
    (tree,) = sources.prepare_checkouts(cell)
    assert tree == tmp_path / "sources" / f"pkg-{commit[:7]}"
    assert sorted(p.name for p in tree.iterdir()) == ["pyproject.toml", "src"]
    assert (tree / "src" / "pkg" / "__init__.py").read_text() == "VERSION = 1\n"
