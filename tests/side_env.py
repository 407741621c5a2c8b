"""A virtual environment of its own beside the project's, for code whose pins differ from the `dev` extra's (verl,
vLLM): built by one command outside any test's timeout, from the package index and the local CPU torch wheel, and
rebuilt when its recipe or the project's dependencies change (the recipe's fingerprint is kept beside it).
tests/verl_env.py and tests/vllm_env.py are the two; `make verl-env` and `make vllm-env` build them, CI both."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"  # the CPU build on local disk (pip's configuration says where)


@dataclass(frozen=True)
class SideEnv:
    """`recipe`: pip install steps, in order (each a list of arguments); `finish`: run with the environment's
    python once they are installed (what pip cannot say: a package to remove, a file to add)."""

    name: str
    path: Path
    recipe: list[list[str]]
    finish: Callable[[Path], None] | None = None
    sources: list[Path] = field(default_factory=list)  # files whose content is part of the recipe

    @property
    def stamp(self) -> Path:
        return self.path / ".recipe"

    def fingerprint(self) -> str:
        """The recipe, its source files and the project's dependencies: a change to any rebuilds it."""
        digest = hashlib.sha256(json.dumps(self.recipe).encode())
        for source in [REPO / "pyproject.toml", *self.sources]:
            digest.update(source.read_bytes())
        return digest.hexdigest()

    def built_python(self) -> Path | None:
        """The environment's python when it is built by the current recipe, else None."""
        python = self.path / "bin" / "python"
        ready = python.exists() and self.stamp.exists() and self.stamp.read_text() == self.fingerprint()
        return python if ready else None

    def python(self) -> Path:
        """The environment's python, the environment built first when it is missing or out of date."""
        python = self.built_python()
        if python is not None:
            return python
        print(f"building {self.name}'s environment under {self.path} (minutes; pip says what it fetches)",
              file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(self.path)], check=True)
        python = self.path / "bin" / "python"
        quiet = ["-q"] if os.environ.get("CI") else []
        for packages in self.recipe:
            subprocess.run([str(python), "-m", "pip", "install", *quiet, "--progress-bar", "off", *packages],
                           check=True)
        if self.finish is not None:
            self.finish(python)
        self.stamp.write_text(self.fingerprint())
        return python
