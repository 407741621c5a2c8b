"""verl's environment for the benchmarks that run verl's own code: verl 0.9.1 pins transformers below 5.11, under
this project's, so it lives in a virtual environment of its own, built once under PACKFEED_VERL_ENV (default
~/.cache/packfeed/verl-0.9.1) from the package index: verl, the CPU torch the project uses, the few modules verl
imports without declaring them, and this project installed beside it without its dependencies.

    .venv/bin/python tests/benchmarks/verl_env.py     # build it (minutes), outside any test's timeout
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VERL_ENV = Path(os.environ.get("PACKFEED_VERL_ENV", Path.home() / ".cache" / "packfeed" / "verl-0.9.1"))
# verl 0.9.1 imports these without declaring them (its router and reward server)
VERL_EXTRAS = ["cachetools", "uvicorn", "fastapi"]
PACKFEED_DEPENDENCIES = ["grpcio-tools", "numba", "pyarrow", "pyyaml", "xxhash", "redis", "scipy", "webdataset",
                         "braceexpand", "pillow", "tokenizers", "tqdm", "matplotlib", "grpcio-health-checking",
                         "grpcio-reflection", "prometheus-client"]


def verl_python() -> Path:
    """The environment's python, the environment built the first time."""
    python = VERL_ENV / "bin" / "python"
    if not (VERL_ENV / ".built").exists():
        print(f"building verl's environment under {VERL_ENV} (once; minutes)", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(VERL_ENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "--progress-bar", "off"]
        subprocess.run(pip + ["torch==2.13.0"], check=True)  # the CPU build (pip's configuration says where)
        subprocess.run(pip + ["verl==0.9.1", *VERL_EXTRAS], check=True)
        subprocess.run(pip + PACKFEED_DEPENDENCIES, check=True)
        subprocess.run(pip + ["--no-deps", "--no-build-isolation", "-e", str(REPO)], check=True)
        (VERL_ENV / ".built").touch()
    return python


if __name__ == "__main__":
    print(verl_python())
