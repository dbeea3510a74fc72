"""The prose holds together: every relative link in the project's markdown reaches a file (and a
heading, where it names one), and the README's two commands are the ones scripts/run and CI run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The project's markdown: top level and the folders that hold docs (never venvs or caches).
DOCS = sorted({*ROOT.glob("*.md"), *(p for d in ("docs", "adapters", "benchmarks", "compat")
                                     for p in (ROOT / d).glob("*.md"))})

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without code blocks and inline code (a link there is not a link)."""
    return _CODE.sub("", _FENCE.sub("", text))


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped (not ``-`` or ``_``), spaces to
    ``-``, a repeated one numbered."""
    found: set[str] = set()
    for heading in _HEADING.findall(_FENCE.sub("", text)):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in found:
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for target in _LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(root) if dest.is_relative_to(root) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(root)}")
    return broken


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_its_file_and_heading(page):
    assert not broken_links(page), f"{page.relative_to(ROOT)}: broken links {broken_links(page)}"


def test_the_link_checker_finds_a_broken_file_and_a_broken_anchor(tmp_path):
    (tmp_path / "b.md").write_text("# The `x.py` file — notes\n## Notes\n## Notes\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#the-xpy-file--notes) [ok](b.md#notes-1) `[code](nowhere.md)` "
                    "[web](https://example.com)\n[bad](nowhere.md) [bad](b.md#nope) [bad](#self)\n")
    assert broken_links(page, root=tmp_path) == [
        "nowhere.md: no nowhere.md", "b.md#nope: no heading #nope in b.md", "#self: no heading #self in a.md"]


def test_the_readme_commands_are_what_scripts_run_and_ci_run():
    """README's first two commands are the demo and the tests; each README command is one of
    scripts/run's; CI runs README's test command."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```bash\n(.*?)^```", readme, re.M | re.S)
    commands = [name for block in blocks for name in re.findall(r"^bash scripts/run (\w+)", block, re.M)]
    assert commands[:2] == ["demo", "pytest"], commands
    usage = (ROOT / "scripts" / "run").read_text()
    for name in commands:
        assert re.search(rf"^\s*{name}\)", usage, re.M), f"README's `bash scripts/run {name}` is not a scripts/run command"
    assert re.search(r"^bash scripts/run pytest\b", (ROOT / ".ci" / "run").read_text(), re.M), \
        ".ci/run does not run README's test command"
