"""The largest samples the default limits refuse, served with the limits raised: a 9,400 x 9,400 PNG (88 MP) and
a conversation of 4.2M tokens, indexed with --max-image-pixels 100000000 --max-sample-tokens 5000000 and served
under a memory budget that holds them (2,048 MiB) and one that does not (64 MiB: skipped with the reason). Printed:
what was served or skipped, the indexing process's peak RSS, and each server tree's peak PSS growth over its
idle footprint against the budget (tests/test_sample_limits.py checks the same with a 300k-token text).

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_sample_limits.py -m benchmark
"""

from __future__ import annotations

import pytest
import yaml

from packfeed.server.serve.worker_process import KEEP_FREED_BYTES
from test_sample_limits import MiB, huge_shard, index_with, served_peak  # noqa: F401  (the shard fixture)

pytestmark = pytest.mark.benchmark


@pytest.mark.parametrize("budget_mb", [64, 2048])
def test_the_largest_samples_served_with_raised_limits(huge_shard, tmp_path, demo_dataset, small_tile_index,  # noqa: F811
                                                      budget_mb):
    path = tmp_path / "index.parquet"
    reasons, index_peak = index_with(huge_shard, path, demo_dataset.tokenizer, "--max-image-pixels", "100000000",
                                     "--max-sample-tokens", "5000000")
    assert reasons["huge-image"] is None and reasons["huge-text"] is None
    config = tmp_path / "server.yaml"
    config.write_text(yaml.safe_dump({"max_skipped_fraction": 1.0, "prepare_timeout_s": 600,
                                      "datasets": {"huge": {"index": str(path), "pixels": "exact"},
                                                   "small": {"index": str(small_tile_index)}}}))
    keys, skipped, growth, _ = served_peak(config, budget_mb, small_tile_index)
    print(f"\n[limits] indexing with the limits raised peaked at {index_peak:.0f} MiB RSS")
    print(f"[limits] budget {budget_mb} MiB: served {sorted(keys)}; skipped {[(k, r[:90]) for k, r in skipped]}")
    print(f"[limits] budget {budget_mb} MiB: the server tree grew {growth / MiB:.0f} MiB (PSS) over its idle "
          f"footprint; bound: the budget + {KEEP_FREED_BYTES / MiB:.0f} MiB a worker keeps for reuse")
    if budget_mb == 64:
        assert {"huge-image", "huge-text"} <= {key for key, _ in skipped}
    else:
        assert {"huge-image", "huge-text"} <= keys
    assert growth <= budget_mb * MiB + KEEP_FREED_BYTES
