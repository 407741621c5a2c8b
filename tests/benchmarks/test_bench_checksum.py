"""What verifying every member costs: the index's XXH3 member checksum against zlib's CRC-32 (the standard
library's alternative) on the demo photographs, and as a share of serving one sample (read, verify, decode,
tile, tokenise) in the same run.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_checksum.py -m benchmark
"""

from __future__ import annotations

import time
import zlib

import pytest

from demo_data import indexed_demo
from packfeed.server.index.table import member_checksum
from packfeed.server.serve.index_rows import IndexRows
from packfeed.server.serve.preprocess import SampleReader

pytestmark = pytest.mark.benchmark


def best_of(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def test_member_checksum_cost(tmp_path):
    paths, index = indexed_demo(tmp_path, 200, 2, 3)
    rows = IndexRows(index)
    members = []
    for sample_id in range(len(rows.table)):
        row = rows.row(sample_id)
        if not row["valid"]:
            continue
        with open(row["shard"], "rb") as shard:
            for offset, size in zip([row["json_offset"], *row["image_offsets"]], [row["json_size"], *row["image_sizes"]]):
                shard.seek(offset)
                members.append(shard.read(size))
    total = sum(len(m) for m in members)
    xxh3 = best_of(lambda: [member_checksum(m) for m in members])
    crc32 = best_of(lambda: [zlib.crc32(m) for m in members])
    reader = SampleReader(rows.info, paths.tokenizer)
    valid = [rows.row(i) for i in range(len(rows.table)) if rows.row(i)["valid"]]
    serve = best_of(lambda: [reader.load(row) for row in valid], repeats=2)
    print(f"\n[checksum] {len(members)} members, {total / 1e6:.1f} MB: XXH3 {xxh3 * 1e3:.2f} ms "
          f"({total / xxh3 / 1e9:.1f} GB/s), zlib CRC-32 {crc32 * 1e3:.2f} ms ({total / crc32 / 1e9:.1f} GB/s)")
    print(f"[checksum] serving {len(valid)} samples took {serve:.2f} s ({serve / len(valid) * 1e3:.1f} ms each); "
          f"verifying them costs {xxh3 / serve * 100:.3f}% of that with XXH3, {crc32 / serve * 100:.2f}% with CRC-32")
    assert xxh3 < crc32
