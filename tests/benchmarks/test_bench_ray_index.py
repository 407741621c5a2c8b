"""`packfeed index --ray`: samples/s of indexing the same shards as Ray tasks on a local cluster with 1 and 2
CPUs (`ray start --head --num-cpus N` on 127.0.0.1), against local worker processes (1 and 2), interleaved.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_ray_index.py -m benchmark
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("ray")

from test_ray_index import start_ray, stop_ray  # noqa: E402

pytestmark = pytest.mark.benchmark


def test_ray_indexing_throughput(tmp_path):
    from packfeed.server.index.config import IndexConfig
    from packfeed.server.index.indexer import build_index
    from packfeed.server.tools.demo import write_demo_dataset

    paths = write_demo_dataset(tmp_path / "demo", samples=480, shards=8, seed=3)
    shards = [str(p) for p in paths.shards]
    config = IndexConfig(tokenizer=str(paths.tokenizer))
    build_index(shards[:1], tmp_path / "warm" / "index.parquet", config, workers=1, progress=False)  # page cache
    for round_ in range(2):
        for workers in (1, 2):
            out = tmp_path / f"local-{round_}-{workers}" / "index.parquet"
            started = time.perf_counter()
            result = build_index(shards, out, config, workers=workers, progress=False)
            wall = time.perf_counter() - started
            print(f"\n[ray index] round {round_ + 1}, local processes x{workers}: {result.rows / wall:.0f} samples/s",
                  end="")
            address, temp = start_ray(workers)
            try:
                out = tmp_path / f"ray-{round_}-{workers}" / "index.parquet"
                started = time.perf_counter()
                on_ray = build_index(shards, out, config, progress=False, ray=address)
                wall = time.perf_counter() - started
            finally:
                stop_ray(temp)
            print(f"\n[ray index] round {round_ + 1}, Ray cluster with {workers} CPU(s): {on_ray.rows / wall:.0f} "
                  f"samples/s (connecting and shutting down the driver included)", end="")
            assert on_ray.rows == result.rows
