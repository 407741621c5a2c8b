"""Soak: one client sends hostile requests (huge counts and strings, garbage bytes, thousands of job ids,
cancels mid-step) while eight ranks stream an epoch from the same server. The ranks get every sample exactly
once, their steps stay within 2x of a quiet run, and the server's memory returns to where it was once the
hostile jobs are closed or evicted. Prints its figures (BENCHMARKS.md "Reliability"):

    .venv/bin/python -m pytest -q -s tests/test_soak.py
"""

from __future__ import annotations

import statistics
import threading
import time
import urllib.request

import grpc
import pytest

from conftest import SMALL_TILE_POLICY
from demo_data import indexed_demo
from packfeed.client import LocalServer, PackStream
from packfeed.server.index.table import read_index
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1 import packfeed_pb2_grpc as pb_grpc
from test_hostile import free_port, wait_for

pytestmark = pytest.mark.slow
DP, EPOCHS, COMPUTE_S = 8, 2, 0.05  # ranks; epochs; seconds of "training" per step (paced like a trainer)
PARTS = "/packfeed.v1.Packfeed/StreamPackParts"


def tree_rss_mib(pid: int) -> float:
    """Resident memory of a process and its children (the server and its workers), MiB."""
    import os

    total, pids = 0, [pid]
    while pids:
        current = pids.pop()
        try:
            with open(f"/proc/{current}/status") as status:
                total += next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
            with open(f"/proc/{current}/task/{current}/children") as children:
                pids += [int(child) for child in children.read().split()]
        except (OSError, StopIteration):
            continue
    return total / 1024 if os.path.exists("/proc") else 0.0


def run_ranks(target: str, job: str) -> tuple[dict[int, list[str]], list[float]]:
    """Every rank's sample keys, and every step's wait for data (seconds), for one epoch at DP 8."""
    keys: dict[int, list[str]] = {}
    waits: list[float] = []
    lock = threading.Lock()

    def rank_loop(rank: int) -> None:
        with PackStream(target, job=job, rank=rank, dp=DP, microbatches=1, epochs=EPOCHS, prefetch=2) as stream:
            mine, before = [], stream.wait_seconds
            for step in stream:
                mine += step.sample_keys
                with lock:
                    waits.append(stream.wait_seconds - before)
                before = stream.wait_seconds
                time.sleep(COMPUTE_S)
        keys[rank] = mine

    threads = [threading.Thread(target=rank_loop, args=(rank,)) for rank in range(DP)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
        assert not thread.is_alive(), "a rank stalled"
    return keys, waits


def hostile(target: str, stop: threading.Event, counts: dict[str, int]) -> None:
    channel = grpc.insecure_channel(target)
    stub = pb_grpc.PackfeedStub(channel)
    raw_open = channel.unary_unary("/packfeed.v1.Packfeed/OpenJob", request_serializer=None,
                                   response_deserializer=None)
    parts = channel.unary_stream(PARTS, request_serializer=pb.StreamPacksRequest.SerializeToString,
                                 response_deserializer=None)
    attacks = [
        lambda k: stub.OpenJob(pb.OpenJobRequest(job=f"h{k}", plan=pb.PlanSpec(dp=2**32 - 1))),
        lambda k: stub.OpenJob(pb.OpenJobRequest(job="x" * (1 << 20), plan=pb.PlanSpec(dp=2))),
        lambda k: raw_open(bytes(range(256)) * 4),
        lambda k: raw_open(b"\x0a\x03\xff\xfe\xfd"),
        *[lambda k, j=j: stub.OpenJob(pb.OpenJobRequest(job=f"many-{k}-{j}", plan=pb.PlanSpec(dp=2, microbatches=1)))
          for j in range(20)],  # thousands of job ids over a run: beyond max_jobs, refused at once
        lambda k: stub.AckStep(pb.AckStepRequest(job=f"many-{k}-0", rank=1, step=10)),
        lambda k: stub.GetJob(pb.GetJobRequest(job=f"nope-{k}" * 100)),
    ]
    k = 0
    while not stop.is_set():
        for attack in attacks:
            try:
                attack(k)
                counts["accepted"] += 1
            except grpc.RpcError as error:
                counts[error.code().name] = counts.get(error.code().name, 0) + 1
        if k % 5 == 0:  # a stream cancelled mid-step
            try:
                call = parts(pb.StreamPacksRequest(job=f"many-{k}-0", rank=0))
                next(call)
                call.cancel()
                counts["cancelled streams"] = counts.get("cancelled streams", 0) + 1
            except grpc.RpcError:
                pass
        k += 1
    channel.close()
    counts["rounds"] = k


def test_eight_ranks_stream_an_epoch_through_a_hostile_client(tmp_path):
    _, index = indexed_demo(tmp_path, 320, 4, 7, SMALL_TILE_POLICY)
    table, _ = read_index(index, columns=["key", "valid"])
    valid = sorted(k for k, v in zip(table.column("key").to_pylist(), table.column("valid").to_pylist()) if v)
    port = free_port()
    env = {"PACKFEED_MAX_JOBS": "16", "PACKFEED_JOB_IDLE_S": "4", "PACKFEED_MEMORY_BUDGET_MB": "256"}
    with LocalServer(index, workers=1, metrics_port=port, env=env) as server:
        metrics = f"http://127.0.0.1:{port}/metrics"

        def gauge(name: str) -> float:
            text = urllib.request.urlopen(metrics, timeout=10).read().decode()
            return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))

        quiet_keys, quiet_waits = run_ranks(server.target, "quiet")
        assert wait_for(lambda: gauge("packfeed_jobs") == 0, 30)  # the quiet job evicted: the baseline
        baseline = tree_rss_mib(server.process.pid)

        stop, counts = threading.Event(), {"accepted": 0}
        attacker = threading.Thread(target=hostile, args=(server.target, stop, counts))
        attacker.start()
        started = time.monotonic()
        keys, waits = run_ranks(server.target, "under-attack")
        elapsed = time.monotonic() - started
        stop.set()
        attacker.join(60)
        peak = tree_rss_mib(server.process.pid)
        assert wait_for(lambda: gauge("packfeed_jobs") == 0, 60), gauge("packfeed_jobs")
        after = tree_rss_mib(server.process.pid)
        held = gauge("packfeed_memory_held_bytes")

    for ledger in (quiet_keys, keys):
        assert sorted(k for rank_keys in ledger.values() for k in rank_keys) == sorted(valid * EPOCHS)
    quiet_median, median = statistics.median(quiet_waits), statistics.median(waits)
    quiet_step, step = COMPUTE_S + quiet_median, COMPUTE_S + median
    print(f"\n[soak] {len(valid)} samples x {EPOCHS} epochs, DP {DP}, {counts['rounds']} hostile rounds in {elapsed:.1f} s: {counts}")
    print(f"[soak] median step (compute {COMPUTE_S * 1e3:.0f} ms + data wait): quiet {quiet_step * 1e3:.1f} ms, "
          f"under attack {step * 1e3:.1f} ms ({step / quiet_step:.2f}x); p90 wait quiet "
          f"{statistics.quantiles(quiet_waits, n=10)[-1] * 1e3:.1f} ms, under attack "
          f"{statistics.quantiles(waits, n=10)[-1] * 1e3:.1f} ms")
    print(f"[soak] server + workers RSS: baseline {baseline:.0f} MiB, peak under attack {peak:.0f} MiB, after "
          f"the hostile jobs were closed or evicted {after:.0f} MiB; budget held {held:.0f} B")
    assert counts.get("INVALID_ARGUMENT", 0) > 0 and counts.get("RESOURCE_EXHAUSTED", 0) > 0
    assert step <= 2 * quiet_step
    assert held == 0
    assert after <= baseline * 1.15 + 30
