"""The commands README.md and docs/ quote: indented code lines that start with a program, with the marker their
block carries (`<!-- run by tests/test_x.py -->`, `<!-- needs: ... -->`, `<!-- synopsis -->`). Read by the
tests that check or run them."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PROGRAMS = ("packfeed", "docker", "torchrun", "make", "python")
MARKER = re.compile(r"<!-- (run by [^>]+|needs: [^>]+|synopsis) -->")


@dataclass
class Command:
    page: str
    line: int
    text: str
    marker: str  # '' where the block has none
    block: int  # commands of one block run in one folder, in order

    @property
    def argv(self) -> list[str]:
        words = shlex.split(self.text)
        while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value before the program
            words = words[1:]
        return words


def quoted_commands() -> list[Command]:
    """Indented code lines that start with a program, continuation lines joined, trailing comments dropped; with
    the marker on the lines just before their block, if any."""
    commands, block = [], 0
    for page in PAGES:
        lines = page.read_text().splitlines()
        marker, in_block, current, start = "", False, "", 0
        for number, line in enumerate(lines, 1):
            found = MARKER.search(line)
            if found and not line.startswith("    "):
                marker = found[1]
                continue
            if not line.startswith("    "):
                if line.strip():
                    marker = "" if in_block else marker  # a marker belongs to the next block only
                    in_block = False
                continue
            block += not in_block
            in_block = True
            code = line.split("  #", 1)[0].strip()
            if not current and not re.match(rf"^([A-Z_]+=\S* )*({'|'.join(PROGRAMS)})\b", code):
                continue
            current, start = current + code.rstrip("\\").strip() + " ", start or number
            if not code.endswith("\\"):
                commands.append(Command(page.name, start, current.strip(), marker, block))
                current, start = "", 0
    return commands


def commands_run_by(test_file: str) -> list[str]:
    """The commands of the blocks marked `<!-- run by TEST_FILE -->` (a path from the repository's folder), in
    order."""
    return [c.text for c in quoted_commands() if c.marker.startswith(f"run by {test_file}")]


def quoted_train(test_file: str) -> tuple[int, list[str]]:
    """(--nproc, the settings) of the one `packfeed train` line in the blocks marked `<!-- run by TEST_FILE ... -->`.
    The test runs it with its own settings appended (later ones win): what the marker says it changes."""
    lines = [c for c in quoted_commands() if c.marker.startswith(f"run by {test_file}") and c.argv[:2] == [
        "packfeed", "train"]]
    assert len(lines) == 1, f"one `packfeed train` line is marked as run by {test_file}: {[c.text for c in lines]}"
    words = lines[0].argv[2:]
    nproc = int(words[words.index("--nproc") + 1]) if "--nproc" in words else 1
    return nproc, [word for word in words if "=" in word]
