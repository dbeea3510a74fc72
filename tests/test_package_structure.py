"""The package's shape: no import cycles, no private names imported across modules, and each
adapter's supported range written once (the extras in ``pyproject.toml`` state it too).

The import graph is read from the source (``ast``): every ``import`` / ``from ... import`` of
``grpo_patches`` and its adapters, at module level and inside functions (a function-level
import still ties two modules together, it only defers the cost). ``from pkg import mod``
is an edge to the module ``pkg.mod``; ``from mod import name`` an edge to ``mod``.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from grpo_patches import registry

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> the package it is installed as (pyproject.toml's package-dir)
SOURCES = {"grpo_patches": ROOT / "grpo_patches", "grpo_patches.adapters": ROOT / "adapters"}

#: Import cycles allowed for now (none: each entry would be one strongly connected component,
#: and an entry that no longer occurs fails too, so that this list only shrinks).
KNOWN_CYCLES: set[frozenset[str]] = set()
#: Private names allowed to be imported across modules for now, as (importing module, imported
#: module, name) (none: the same rule).
KNOWN_PRIVATE_IMPORTS: set[tuple[str, str, str]] = set()


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package) for every module of the package and its adapters."""
    found = {}
    for package, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join([package, *parts[:-1]] if is_package else [package, *parts])] = (path, is_package)
    return found


def _imports(modules: dict[str, tuple[Path, bool]]) -> tuple[dict[str, set[str]], set[tuple[str, str, str]]]:
    """The import graph (module -> modules it imports) and every ``from <other module> import _name``."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    private: set[tuple[str, str, str]] = set()
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                graph[name] |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    if f"{source}.{alias.name}" in modules:
                        graph[name].add(f"{source}.{alias.name}")
                    elif source in modules:
                        graph[name].add(source)
                        if alias.name.startswith("_") and not alias.name.startswith("__") and source != name:
                            private.add((name, source, alias.name))
        graph[name].discard(name)
    return graph, private


def _cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


GRAPH, PRIVATE = _imports(_modules())


def test_the_graph_sees_the_package():
    """The reader finds what it must (else the tests below could not fail)."""
    assert "grpo_patches.api" in GRAPH["grpo_patches"]  # module level, package __init__
    assert "grpo_patches.savings_totals" in GRAPH["grpo_patches.defaults"]  # inside a function
    assert "grpo_patches.adapters.trl.state" in GRAPH["grpo_patches.adapters.trl.metrics"]  # relative
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == {frozenset("abc")}


def test_no_import_cycles():
    cycles = _cycles(GRAPH)
    new = [sorted(c) for c in cycles - KNOWN_CYCLES]
    assert not new, f"import cycles: {new}; make the dependency go one way (move what both need)"
    gone = [sorted(c) for c in KNOWN_CYCLES - cycles]
    assert not gone, f"{gone} no longer form a cycle: remove them from KNOWN_CYCLES"


def test_no_private_names_imported_across_modules():
    new = sorted(PRIVATE - KNOWN_PRIVATE_IMPORTS)
    assert not new, f"(module, from, name) importing another module's private name: {new}; make it public"
    gone = sorted(KNOWN_PRIVATE_IMPORTS - PRIVATE)
    assert not gone, f"{gone} are no longer imported: remove them from KNOWN_PRIVATE_IMPORTS"


def _extras() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {name: [Requirement(r) for r in reqs] for name, reqs in project["optional-dependencies"].items()}


@pytest.mark.parametrize("framework", ["trl", "verl"])
def test_each_extra_states_its_adapters_supported_range(framework):
    """``pip install grpo-patches[trl]`` installs a version the adapter supports, and only such."""
    adapter = registry.get(framework)
    pinned = [r for r in _extras()[framework] if r.name == adapter.distribution]
    assert len(pinned) == 1, f"extra {framework!r} must require {adapter.distribution} once"
    assert pinned[0].specifier == SpecifierSet(adapter.supported), (
        f"extra {framework!r} says {adapter.distribution}{pinned[0].specifier}, the adapter supports {adapter.supported}"
    )


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports (absolute imports, at any depth of the file)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


#: Test modules allowed to import another for now (none).
KNOWN_TEST_IMPORTS: dict[str, list[str]] = {}


def test_test_modules_never_import_each_other():
    """What two test modules share lives in ``tests/helpers/`` (collecting one test module must
    not run another's module-level code, nor tie their fixtures and caches together)."""
    offenders = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        imported = sorted(m for m in _imported_modules(path)
                          if any(part.startswith("test_") for part in m.split(".")[1:]) and m.startswith("tests."))
        if imported:
            offenders[str(path.relative_to(ROOT))] = imported
    assert offenders == KNOWN_TEST_IMPORTS


def test_the_checker_sees_a_test_module_import(tmp_path):
    sample = tmp_path / "test_x.py"
    sample.write_text("def f():\n    from tests.test_trl_filter import run\n")
    assert "tests.test_trl_filter" in _imported_modules(sample)


def test_shared_test_code_lives_in_tests_helpers():
    """``tests/`` holds test modules, ``conftest.py`` and the NeMo-RL cells' package; every
    harness or stand-in two test modules share is under ``tests/helpers/``."""
    loose = sorted(p.name for p in (ROOT / "tests").glob("*.py")
                   if not p.name.startswith("test_") and p.name not in ("__init__.py", "conftest.py"))
    assert loose == []


def test_benchmarks_never_import_the_tests():
    """What a benchmark and a test share lives in the test kit (``grpo_patches_testing``), the
    demo (``grpo_patches.demo``) or ``benchmarks/``: no ``tests.*`` import, no repository root put
    on ``sys.path`` to reach one."""
    offenders = {}
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        tests = sorted(m for m in _imported_modules(path) if m == "tests" or m.startswith("tests."))
        if tests or "parents[1]))" in path.read_text() or "sys.path.insert(0, str(ROOT))" in path.read_text():
            offenders[path.name] = tests or ["the repository root on sys.path"]
    assert offenders == {}


def test_the_benchmark_checker_sees_a_tests_import(tmp_path):
    sample = tmp_path / "bench.py"
    sample.write_text("def f():\n    from tests.helpers.trl_runs import train\n")
    assert "tests.helpers.trl_runs" in _imported_modules(sample)


ADAPTERS = ROOT / "adapters"
FRAMEWORKS = sorted(p.parent.name for p in ADAPTERS.glob("*/__init__.py"))


def _adapter_modules() -> list[Path]:
    return sorted(p for p in ADAPTERS.glob("*/*.py"))


def _names_used(path: Path, name: str) -> int:
    """How often ``name`` appears as a name or an attribute in ``path``."""
    return sum(1 for node in ast.walk(ast.parse(path.read_text(), str(path)))
               if (isinstance(node, ast.Name) and node.id == name) or (isinstance(node, ast.Attribute) and node.attr == name))


def test_no_context_var_outside_the_call_context_module():
    """Who hands what to whom within one framework call is read in one place: an adapter's
    per-call contexts are :class:`grpo_patches.call_context.CallSlot` s declared in its
    ``state.py``; the only ``ContextVar`` is the one inside ``CallSlot``."""
    holders = {str(p.relative_to(ROOT)) for p in [*_adapter_modules(), *(ROOT / "grpo_patches").rglob("*.py")]
               if _names_used(p, "ContextVar")}
    holders.discard("grpo_patches/call_context.py")
    assert not holders, f"{sorted(holders)} hold a ContextVar: declare a CallSlot in the adapter's state.py instead"


def _framework_strings(path: Path, framework: str) -> int:
    return sum(1 for node in ast.walk(ast.parse(path.read_text(), str(path)))
               if isinstance(node, ast.Constant) and node.value == framework)


def test_an_adapter_names_its_framework_once_in_its_init():
    """Every module of an adapter asks the adapter handle (``FRAMEWORK`` in its ``__init__``:
    :class:`grpo_patches.adapter_handle.AdapterHandle`) instead of naming the framework."""
    found = {}
    for path in _adapter_modules():
        if path.name != "__init__.py":
            count = _framework_strings(path, path.parent.name)
            if count:
                found[str(path.relative_to(ROOT))] = count
    assert not found, f"{found} name their framework by a string: ask the adapter handle (FRAMEWORK) instead"


def test_the_checkers_see_a_context_var_and_a_framework_string(tmp_path):
    sample = tmp_path / "x.py"
    sample.write_text("import contextvars\nV = contextvars.ContextVar('v')\nNAME = 'trl'\n")
    assert _names_used(sample, "ContextVar") == 1 and _framework_strings(sample, "trl") == 1


#: Each adapter's section of adapters/README.md, by the heading that opens it.
ADAPTER_SECTIONS = {"trl": "## The TRL adapter", "verl": "## The verl adapter", "nemo_rl": "## The NeMo-RL adapter",
                    "open_instruct": "## The open-instruct adapter"}


def _readme_section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end >= 0 else len(text)]


def test_every_adapter_module_is_named_in_its_adapters_section_of_the_readme():
    """``adapters/README.md`` is the map: every module of every adapter is on its own adapter's table
    (a file name another adapter shares, ``trim.py`` say, does not count for both)."""
    text = (ADAPTERS / "README.md").read_text()
    folders = {p.parent.name for p in _adapter_modules()}
    assert not folders - set(ADAPTER_SECTIONS), f"{sorted(folders - set(ADAPTER_SECTIONS))}: add a section for it"
    missing = sorted(f"{p.parent.name}/{p.name}" for p in _adapter_modules()
                     if f"`{p.name}`" not in _readme_section(text, ADAPTER_SECTIONS[p.parent.name]))
    assert not missing, f"adapters/README.md does not name {missing}: add each to its adapter's table"


def test_a_module_named_only_in_another_adapters_section_is_missing():
    text = (ADAPTERS / "README.md").read_text()
    assert "`trim.py`" in _readme_section(text, ADAPTER_SECTIONS["trl"])
    assert "`verify_driver.py`" not in _readme_section(text, ADAPTER_SECTIONS["trl"])
