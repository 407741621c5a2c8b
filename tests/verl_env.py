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

import os
from pathlib import Path

from side_env import REPO, TORCH, SideEnv

VERL_ENV = Path(os.environ.get("PACKFEED_VERL_ENV", Path.home() / ".cache" / "packfeed" / "verl-0.9.1"))
VERL = "verl[verl-core]==0.9.1"
# verl 0.9.1 imports these without declaring them (its router and reward server)
VERL_UNDECLARED = ["cachetools", "uvicorn", "fastapi"]
ENV = SideEnv("verl", VERL_ENV, [[TORCH], [VERL, *VERL_UNDECLARED], ["-e", str(REPO)]])
built_python = ENV.built_python

if __name__ == "__main__":
    print(ENV.python())
