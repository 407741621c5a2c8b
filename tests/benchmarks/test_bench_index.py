"""Indexing throughput: rows/s per core on the demo dataset (real photos, 200-1600 px), one worker,
image verification by decode (default) vs header only.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_index.py -m benchmark
"""

from __future__ import annotations

import pytest

from packfeed.server.index.config import IndexConfig
from packfeed.server.index.indexer import build_index
from packfeed.server.tools.demo import write_demo_dataset

pytestmark = pytest.mark.benchmark


def test_index_rows_per_core(tmp_path):
    demo = write_demo_dataset(tmp_path / "demo", samples=400, shards=4, seed=2)
    for verify in ("decode", "header"):
        config = IndexConfig(tokenizer=str(demo.tokenizer), verify_images=verify)
        build_index([str(p) for p in demo.shards[:1]], tmp_path / "warm.parquet", config, workers=1, progress=False)
        result = build_index([str(p) for p in demo.shards], tmp_path / f"{verify}.parquet", config, workers=1,
                             progress=False)
        s = result.summary()
        print(f"\n[index] verify={verify}: {s['rows']} rows in {s['seconds']:.2f} s = "
              f"{s['rows_per_second_per_core']:.0f} rows/s per core (1 worker)")
        assert s["rows"] == 400
