"""Serving from object storage against local files: samples/s of one epoch streamed to 8 concurrent ranks, and
how long a rank waits for a step, with shards on local disk, in a real S3-protocol server on 127.0.0.1 (moto's,
a Python process: slower than a real store per request), and behind 30 ms of added latency per request (a
distant store) with range requests one at a time or 16 in flight per worker. `pixels: encoded`, so the
server's CPU work is small and the storage path shows; the ranks read raw messages (no decoding).

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_object_storage.py -m benchmark
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import yaml

pytest.importorskip("s3fs")
pytest.importorskip("moto")

from demo_data import indexed_demo  # noqa: E402
from s3_server import FaultyProxy, S3Server, restore_env, set_env  # noqa: E402

pytestmark = pytest.mark.benchmark
DP = 8


def stream_epoch(target: str, job: str) -> tuple[int, float, float]:
    """(samples, wall seconds, mean seconds a rank waited for each step) for DP ranks at once."""
    from packfeed.v1 import packfeed_pb2 as pb, packfeed_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 1 << 30)])
    stub = pb_grpc.PackfeedStub(channel)
    stub.OpenJob(pb.OpenJobRequest(job=job, plan=pb.PlanSpec(dp=DP, microbatches=1)))
    counts, waits = [0] * DP, [[] for _ in range(DP)]

    def rank(r: int) -> None:
        last = time.perf_counter()
        for pack in stub.StreamPacks(pb.StreamPacksRequest(job=job, rank=r)):
            now = time.perf_counter()
            waits[r].append(now - last)
            last = now
            counts[r] += len(pack.sample_keys)

    started = time.perf_counter()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(DP)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    channel.close()
    all_waits = [w for rank_waits in waits for w in rank_waits]
    return sum(counts), wall, sum(all_waits) / max(1, len(all_waits))


def serve_and_stream(index, env: dict[str, str], tmp_path, name: str) -> tuple[int, float, float]:
    from packfeed.client import LocalServer

    config = tmp_path / f"{name}.yaml"
    config.write_text(yaml.safe_dump({"datasets": {"d": {"index": str(index), "pixels": "encoded"}}}))
    with LocalServer(config=config, workers=2, env=env) as server:
        stream_epoch(server.target, "warm")
        return stream_epoch(server.target, "measured")


def test_serving_from_s3_against_local_files(tmp_path):
    import s3fs

    from packfeed.server.index.config import IndexConfig
    from packfeed.server.index.indexer import build_index

    paths, local_index = indexed_demo(tmp_path / "demo", 240, 4, 2)
    s3 = S3Server().start()
    proxy = FaultyProxy(s3.endpoint, tmp_path, every=0, delay_ms=30).start()
    previous = set_env(s3.env)
    try:
        fs = s3fs.S3FileSystem(endpoint_url=s3.endpoint, skip_instance_cache=True)
        fs.mkdir("bench")
        for shard in paths.shards:
            fs.put_file(str(shard), f"s3://bench/demo/{shard.name}")
        s3_index = tmp_path / "s3.parquet"
        build_index(["s3://bench/demo/*.tar"], s3_index, IndexConfig(tokenizer=str(paths.tokenizer)), workers=1,
                    progress=False)
        cases = {"local files": (local_index, {}),
                 "S3 (moto), 16 ranges in flight": (s3_index, s3.env),
                 "S3 + 30 ms, 1 range at a time": (s3_index, {**proxy.env, "PACKFEED_RANGE_THREADS": "1"}),
                 "S3 + 30 ms, 16 ranges in flight": (s3_index, proxy.env)}
        for round_ in range(2):
            for name, (index, env) in cases.items():
                samples, wall, wait = serve_and_stream(index, env, tmp_path, f"case{round_}")
                print(f"\n[object storage] round {round_ + 1}, {name}: {samples} samples to {DP} ranks in {wall:.2f} s "
                      f"= {samples / wall:.0f} samples/s; a rank waited {wait * 1e3:.0f} ms per step", end="")
                assert samples > 200
    finally:
        restore_env(previous)
        proxy.stop()
        s3.stop()
