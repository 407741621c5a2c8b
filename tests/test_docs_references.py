"""The docs point at what exists: every relative link in README.md, docs/, BENCHMARKS.md and the folders' READMEs
names a file that is there (and a heading of it, for `#anchor` links), and every section quoted by name in them
or in the code's comments (`BENCHMARKS "Cold start"`, `protos/README.md "Limits"`) is a heading of that file. A
page moved or a heading renamed shows here, not in a reader's dead end."""

from __future__ import annotations

import functools
import re
from pathlib import Path

from doc_commands import REPO

PAGES = [REPO / "README.md", REPO / "BENCHMARKS.md", REPO / "protos/README.md", REPO / "docker/README.md",
         *sorted((REPO / "docs").glob("*.md"))]
SOURCES = [path for folder in ("loader_server", "client", "trainer", "media", "protos", "examples", "tests")
           for path in sorted((REPO / folder).rglob("*")) if path.suffix in (".py", ".proto", ".yaml")
           and "_pb2" not in path.name and "__pycache__" not in path.parts]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
QUOTED_SECTION = re.compile(r"\b(BENCHMARKS(?:\.md)?|protos/README\.md|docs/[a-z]+\.md)\"? \"([^\"]+)\"")


@functools.cache  # a page is read once however many references point into it
def headings(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # not comment lines in code
    return [line.lstrip("#").strip() for line in text.splitlines() if re.match(r"#{1,6} ", line)]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def references() -> list[tuple[Path, str, str]]:
    """(page, target file or '', anchor or heading) of every relative link and every quoted section name."""
    found = []
    for page in PAGES + SOURCES:
        text = page.read_text()
        for target in LINK.findall(text) if page.suffix == ".md" else []:
            if not re.match(r"[a-z]+:", target):
                path, _, fragment = target.partition("#")
                found.append((page, str((page.parent / path).resolve()) if path else str(page), "#" + fragment))
        for name, section in QUOTED_SECTION.findall(text):
            path = REPO / ("BENCHMARKS.md" if name.startswith("BENCHMARKS") else name)
            found.append((page, str(path), " ".join(section.split())))  # a name may wrap a line
    return found


def test_the_pages_hold_references():
    """The scan sees links and quoted sections (a check over none would pass by itself)."""
    found = references()
    kinds = {("#" if ref.startswith("#") else "section") for _, _, ref in found}
    assert kinds == {"#", "section"} and len(found) > 30


def test_every_link_and_quoted_section_exists():
    broken = []
    for page, target, ref in references():
        where = f"{page.relative_to(REPO)} -> {Path(target).relative_to(REPO)}"
        if not Path(target).exists():
            broken.append(f"{where}: no such file")
        elif ref == "#" or Path(target).is_dir() or not target.endswith(".md"):
            continue
        elif ref.startswith("#") and ref[1:] not in {anchor(h) for h in headings(Path(target))}:
            broken.append(f"{where}{ref}: no such heading")
        elif not ref.startswith("#") and ref not in headings(Path(target)):
            broken.append(f'{where} "{ref}": no such heading')
    assert broken == []


def test_the_anchor_rule_is_githubs():
    assert anchor("Predict before you run: `packfeed simulate`") == "predict-before-you-run-packfeed-simulate"
    assert anchor("CPU per delivered sample against InternVL's loader as it runs") == \
        "cpu-per-delivered-sample-against-internvls-loader-as-it-runs"


def test_every_headline_figure_names_the_command_of_its_section():
    """BENCHMARKS.md's headline table: each row links to a section, and its command is the one that section
    quotes (so the summary cannot drift from where the figure was measured)."""
    text = (REPO / "BENCHMARKS.md").read_text()
    sections = {anchor(part.splitlines()[0].lstrip("#").strip()): " ".join(part.split())
                for part in re.split(r"\n(?=#{2,4} )", text)}
    table = text.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| \[[^\]]+\]\(#([^)]+)\) \|.*\| `([^`]+)` \| (\d{4}-\d\d-\d\d) \|$", table, flags=re.M)
    assert len(rows) >= 8
    assert [(section, command) for section, command, _ in rows if command not in sections.get(section, "")] == []


def python_blocks() -> list[tuple[Path, str]]:
    blocks = []
    for page in PAGES:
        for found in re.finditer(r"^( *)```python\n(.*?)^\1```", page.read_text(), flags=re.M | re.S):
            blocks.append((page, "\n".join(line[len(found[1]):] for line in found[2].splitlines())))
    return blocks


def test_the_docs_python_is_python_and_imports_what_exists():
    """Every ```python block in the docs parses, and each name it imports from Packfeed exists there."""
    import ast
    import importlib

    blocks = python_blocks()
    assert len(blocks) >= 5
    missing = []
    for page, code in blocks:
        tree = ast.parse(code, filename=str(page))  # a SyntaxError names the page
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module.startswith("packfeed"):
                module = importlib.import_module(node.module)
                missing += [f"{page.name}: {node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)]
    assert missing == []
