"""Reliability figures: failover under kill -9 with a sample ledger, and many concurrent streams
on one server within its memory budget.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_failover.py -m benchmark

1. 3 Redis-coordinated servers, 8 ranks (M 1, 2 epochs), kill -9 of one server mid-epoch: every rank
   finishes; the ledger of sample keys per epoch shows how many were lost or repeated; time to resume is
   the longest gap between two steps of a rank that had to fail over; streams compared with one server's.
2. 64 concurrent rank streams on one server (budget 256 MB): peak RSS of the server and its workers, and
   whether every stream progressed.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from pathlib import Path

import pytest
from demo_data import indexed_demo
from packfeed.client import LocalServer, PackStream
from redis_server import RedisProcess
from test_service import step_digest, valid_keys

pytestmark = pytest.mark.benchmark


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    return indexed_demo(tmp_path_factory.mktemp("bench-failover"), 240, 4, 7)[1]


def consume(targets, job, rank, dp, epochs, out, pace_s=0.0, **kwargs):
    records = out.setdefault(rank, [])
    with PackStream(targets, job=job, rank=rank, dp=dp, microbatches=1, epochs=epochs, prefetch=1, retries=10,
                    backoff=0.25, **kwargs) as stream:
        for step in stream:
            records.append((step.epoch, step.step, step.sample_keys, step_digest(step), time.monotonic()))
            time.sleep(pace_s)


def test_kill_one_of_three_servers_with_eight_ranks(index, tmp_path):
    dp, epochs, ttl = 8, 2, 3.0
    redis = RedisProcess(tmp_path / "redis").start()
    env = {"PACKFEED_REDIS_URL": redis.url, "PACKFEED_LEASE_TTL_S": str(ttl)}
    servers = [LocalServer(index, workers=1, env=env).start() for _ in range(3)]
    single = LocalServer(index, workers=1).start()
    try:
        reference: dict[int, list] = {}
        for rank in range(dp):
            consume([single.target], "soak", rank, dp, epochs, reference)
        shared: dict[int, list] = {}
        threads = [threading.Thread(target=consume, args=([servers[(rank + k) % 3].target for k in range(3)],
                                                          "soak", rank, dp, epochs, shared, 0.2))
                   for rank in range(dp)]
        for thread in threads:
            thread.start()
        while sum(len(r) for r in shared.values()) < dp:  # every rank under way
            time.sleep(0.05)
        killed_at = time.monotonic()
        servers[0].process.kill()
        for thread in threads:
            thread.join(600)
    finally:
        for server in servers + [single]:
            server.stop()
        redis.stop()
    expected = collections.Counter(valid_keys(index))
    for epoch in range(epochs):
        got = collections.Counter(k for r in shared.values() for e, _, keys, _, _ in r if e == epoch for k in keys)
        lost, repeated = sum((expected - got).values()), sum((got - expected).values())
        print(f"\n[failover] epoch {epoch}: {sum(got.values())} samples delivered, {lost} lost, {repeated} repeated")
        assert lost == 0 and repeated == 0
    failed_over = [0, 3, 6]  # ranks whose first server was killed
    gaps = [b[4] - a[4] for rank in failed_over for a, b in zip(shared[rank], shared[rank][1:]) if b[4] > killed_at]
    identical = all([(e, s, d) for e, s, _, d, _ in shared[r]] == [(e, s, d) for e, s, _, d, _ in reference[r]]
                    for r in range(dp))
    print(f"[failover] 3 servers, {dp} ranks, kill -9 of one mid-epoch: longest gap on a failed-over rank "
          f"{max(gaps):.1f} s (lease TTL {ttl:g} s, client pace 0.2 s/step); streams identical to one server's: "
          f"{identical}")
    assert identical


def rss_kib(pid: int) -> int:
    """Peak resident set (VmHWM) of a process and its children (the worker pool)."""
    total = 0
    for task in [pid] + children(pid):
        try:
            for line in Path(f"/proc/{task}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if parent == pid:
                found += [int(entry)] + children(int(entry))
    return found


def serve_streams(index, ranks: list[int], dp: int, budget_mb: int) -> dict:
    """A fresh server; the given ranks of a dp-rank job stream 3 epochs at once. Peak RSS (VmHWM) of the
    server and its worker, steps per rank, seconds, and whether every stream finished."""
    with LocalServer(index, workers=1, env={"PACKFEED_MEMORY_BUDGET_MB": str(budget_mb)}) as server:
        out: dict[int, list] = {}
        started = time.monotonic()
        threads = [threading.Thread(target=consume, args=([server.target], "many", rank, dp, 3, out))
                   for rank in ranks]
        for thread in threads:
            thread.start()
        peak = 0
        while any(t.is_alive() for t in threads) and time.monotonic() - started < 600:
            peak = max(peak, rss_kib(server.process.pid))
            time.sleep(0.5)
        peak = max(peak, rss_kib(server.process.pid))
        stuck = [t for t in threads if t.is_alive()]
    return {"peak_mib": peak / 1024, "steps": [len(out.get(rank, [])) for rank in ranks], "stuck": len(stuck),
            "seconds": time.monotonic() - started}


def test_sixty_four_streams_on_one_server(index):
    """Memory: 64 streams against the same server serving one stream of the same job (its baseline: code,
    plan, worker), so the difference is what the streams hold: the budget bounds it."""
    dp, budget_mb = 64, 256
    one = serve_streams(index, [0], dp, budget_mb)
    many = serve_streams(index, list(range(dp)), dp, budget_mb)
    print(f"\n[streams] 1 stream: peak RSS of server + worker {one['peak_mib']:.0f} MiB")
    print(f"[streams] {dp} concurrent rank streams, 3 epochs: every stream finished: {not many['stuck']}; steps per "
          f"rank {min(many['steps'])}-{max(many['steps'])}; {many['seconds']:.1f} s; peak RSS of server + worker "
          f"{many['peak_mib']:.0f} MiB, {many['peak_mib'] - one['peak_mib']:+.0f} MiB over 1 stream "
          f"(pack budget {budget_mb} MiB)")
    assert not many["stuck"] and min(many["steps"]) > 0
