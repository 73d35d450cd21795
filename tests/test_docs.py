"""The repository explains itself: every relative link in the README and docs/ resolves (to
a file, and to a heading where it names one), every doc the code cites exists, and nothing
cites a document outside the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "harness" / "README.md", *DOCS]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
CITED = re.compile(r"(?<![\w/.-])((?:\.\./)*docs/[\w./-]+\.md)(#[\w-]+)?")
#: Documents that live outside the repository and so must never be cited by its files.
OUTSIDE = re.compile(r"\.\./shared|DESIGN §|DESIGN\.md|PROTOCOLS\.md|STYLE\.md")


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / p for p in out if (ROOT / p).is_file()]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # a '#' in a code block is no heading
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _check(source: Path, target: str) -> str | None:
    """Why the link ``target`` in ``source`` does not resolve, or None."""
    if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
        return None
    path, _, anchor = target.partition("#")
    dest = (source.parent / path).resolve() if path else source
    if not dest.exists():
        return f"{_rel(source)}: {target} -> no such file"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{_rel(source)}: {target} -> no heading #{anchor} in {dest.name}"
    return None


def test_the_docs_exist():
    names = {p.name for p in DOCS}
    expected = {"design.md", "methods.md", "default-suite.md", "speed.md", "deploy.md"}
    assert expected | {"cli.md", "plugins.md", "footguns.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    targets = [a or b for a, b in LINK.findall(text)]
    bad = [why for t in targets if (why := _check(page, t))]
    assert not bad, "\n".join(bad)


def test_every_doc_the_code_cites_exists():
    files = _tracked("*.py", "*.yaml", "*.toml", "*.md", ".ci/run")
    citations = []
    for f in files:
        for m in CITED.finditer(f.read_text(encoding="utf-8", errors="replace")):
            citations.append((f, m.group(1), m.group(2)))
    assert citations, "the code cites no doc: the pattern is broken"
    bad = []
    for f, path, anchor in citations:
        dest = ROOT / re.sub(r"^(\.\./)+", "", path)
        if not dest.is_file():
            bad.append(f"{f.relative_to(ROOT)} cites {path}: no such file")
        elif anchor and anchor[1:] not in anchors(dest):
            bad.append(f"{f.relative_to(ROOT)} cites {path}{anchor}: no such heading")
    assert not bad, "\n".join(bad)


def test_nothing_cites_a_document_outside_the_repository():
    files = _tracked("*.py", "*.yaml", "*.toml", "*.md", ".ci/run")
    this = Path(__file__).resolve()
    bad = [
        f"{f.relative_to(ROOT)}:{n}: {line.strip()}"
        for f in files
        if f.resolve() != this
        for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not bad, "\n".join(bad)


def test_the_link_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\nsee [x](missing.md) and [y](#title) and [z](#nope)\n")
    assert _check(page, "missing.md").endswith("no such file")
    assert _check(page, "#title") is None
    assert "no heading #nope" in _check(page, "#nope")
