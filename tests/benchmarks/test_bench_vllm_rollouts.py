"""Rollouts per second and CPU per rollout, HF `generate` against vLLM (`VLLMEngine` in the process, and a vLLM
server through `VLLMServerEngine`), on one tiny Qwen2-VL, the same prompts (a Packfeed prompt job, images included)
and machine, in one run; and the host memory of one prompt's images, shared preprocessing against each side keeping
its own (tests/benchmarks/vllm_rollouts_bench.py says how
each is run and counted).

Run: make vllm-env (once: builds vLLM's environment, minutes), then
.venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_vllm_rollouts.py -m benchmark
"""

from __future__ import annotations

import json
import statistics
import subprocess
from pathlib import Path

import pytest

from vllm_env import VLLM_ENV, built_python

pytestmark = pytest.mark.benchmark
SCRIPT = Path(__file__).with_name("vllm_rollouts_bench.py")


def test_vllm_rollouts_against_hf_generate(tmp_path):
    python = built_python()
    if python is None:
        pytest.skip(f"vLLM's environment is not built under {VLLM_ENV}: run `make vllm-env`")
    done = subprocess.run([str(python), str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=1800,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    rounds = [line for line in lines if "method" in line]
    for method in ("hf_generate", "vllm", "vllm_server"):
        mine = [r for r in rounds if r["method"] == method]
        rates = [r["completions"] / r["seconds"] for r in mine]
        cpu = [1000 * r["cpu_seconds"] / r["completions"] for r in mine]
        print(f"{method}: {statistics.median(rates):.1f} rollouts/s (rounds {min(rates):.1f}-{max(rates):.1f}), "
              f"{statistics.median(cpu):.1f} CPU ms per rollout ({min(cpu):.1f}-{max(cpu):.1f}), "
              f"{len(mine)} rounds of {mine[0]['completions']}")
    memory = next(line["memory"] for line in lines if "memory" in line)
    mib = {name: value / 2**20 for name, value in memory.items() if name != "tokens"}
    print(f"one image (448 x 448, {memory['tokens']} tokens): shared {mib['shared']:.2f} MiB (pixels "
          f"{mib['pixel_bytes']:.2f} + embeddings {mib['embedding_bytes']:.2f}), each its own {mib['own']:.2f} MiB "
          f"(pixels twice + decoded {mib['decoded_bytes']:.2f})")
    assert {r["method"] for r in rounds} == {"hf_generate", "vllm", "vllm_server"}
    assert memory["shared"] < memory["own"]
