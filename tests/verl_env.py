"""verl's own environment, for the tests and benchmarks that run verl's code: verl 0.9.1 pins transformers below
5.11, under this project's `hf` extra, so it lives in a virtual environment of its own, built by one command
outside any test's timeout (`make verl-env`; CI runs it) under PACKFEED_VERL_ENV (default
~/.cache/packfeed/verl-0.9.1), as a verl user builds theirs:

- the CPU torch the project uses (verl's dependencies leave torch to the user);
- `verl[verl-core]==0.9.1` from the package index (its v1 trainers, verl's default, need TransferQueue), and the
  few modules verl imports without declaring them;
- then plain `packfeed` (this checkout, editable) with its own dependencies, none of which moves verl's pins.

An environment built by an older recipe is rebuilt: the recipe's fingerprint is kept beside it.

    make verl-env      # or: python3 tests/verl_env.py
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VERL_ENV = Path(os.environ.get("PACKFEED_VERL_ENV", Path.home() / ".cache" / "packfeed" / "verl-0.9.1"))
TORCH = "torch==2.13.0"  # the CPU build (pip's configuration says where)
VERL = "verl[verl-core]==0.9.1"
# verl 0.9.1 imports these without declaring them (its router and reward server)
VERL_UNDECLARED = ["cachetools", "uvicorn", "fastapi"]
RECIPE = [[TORCH], [VERL, *VERL_UNDECLARED], ["-e", str(REPO)]]
STAMP = VERL_ENV / ".recipe"


def fingerprint() -> str:
    """The recipe and the project's dependencies: a change to either rebuilds the environment."""
    pyproject = (REPO / "pyproject.toml").read_bytes()
    return hashlib.sha256(json.dumps(RECIPE).encode() + pyproject).hexdigest()


def built_python() -> Path | None:
    """The environment's python when it is built by the current recipe, else None."""
    python = VERL_ENV / "bin" / "python"
    ready = python.exists() and STAMP.exists() and STAMP.read_text() == fingerprint()
    return python if ready else None


def verl_python() -> Path:
    """The environment's python, the environment built first when it is missing or out of date."""
    python = built_python()
    if python is not None:
        return python
    print(f"building verl's environment under {VERL_ENV} (minutes; pip says what it fetches)", file=sys.stderr,
          flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VERL_ENV)], check=True)
    python = VERL_ENV / "bin" / "python"
    quiet = ["-q"] if os.environ.get("CI") else []
    for packages in RECIPE:
        subprocess.run([str(python), "-m", "pip", "install", *quiet, "--progress-bar", "off", *packages],
                       check=True)
    STAMP.write_text(fingerprint())
    return python


if __name__ == "__main__":
    print(verl_python())
