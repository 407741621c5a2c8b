"""Time from starting `packfeed serve` to the first pack in the client, for a fresh process with a cold numba
cache (the planner's kernels compile for the first job) against one whose cache `packfeed warmup` filled (a
server image built with it, a venv installed by `make venv`), on the demo dataset.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_cold_start.py -m benchmark
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from demo_data import indexed_demo

pytestmark = pytest.mark.benchmark


def first_pack_seconds(index, cache_dir) -> tuple[float, float]:
    """(seconds until the server said it serves, seconds until the first pack arrived), from process start."""
    from packfeed.client import LocalServer, PackStream

    started = time.perf_counter()
    with LocalServer(index, workers=1, env={"NUMBA_CACHE_DIR": str(cache_dir)}) as server:
        serving = time.perf_counter() - started
        with PackStream(server.target, job="first", rank=0, dp=2, microbatches=2) as stream:
            assert next(iter(stream)).sample_keys
        return serving, time.perf_counter() - started


def test_first_pack_with_a_cold_and_a_warmed_cache(tmp_path):
    _, index = indexed_demo(tmp_path, 240, 4, 2)
    results = {}
    for round_ in range(2):
        for name in ("cold", "warmed"):
            cache = tmp_path / f"cache-{name}-{round_}"
            if name == "warmed":
                warm = subprocess.run([sys.executable, "-m", "packfeed.cli", "warmup"], capture_output=True,
                                      text=True, env={**os.environ, "NUMBA_CACHE_DIR": str(cache)}, timeout=600)
                assert warm.returncode == 0, warm.stderr
            results[name, round_] = first_pack_seconds(index, cache)
            serving, first = results[name, round_]
            print(f"\n[cold start] round {round_ + 1}, {name} cache: serving after {serving:.1f} s, first pack after "
                  f"{first:.1f} s", end="")
    assert all(first > 0 for _, first in results.values())
