"""Soak: one client sends hostile requests (huge counts and strings, garbage bytes, thousands of job ids,
cancels mid-step) while eight ranks stream an epoch from the same server. The ranks get every sample exactly
once and the memory budget is all returned once the hostile jobs are closed or evicted. The speed and memory
goals (steps within 2x of a quiet run, resident memory back where it was) are checked by
tests/benchmarks/test_bench_soak.py on the same run, not here: a shared CI machine is too noisy for them.
"""

from __future__ import annotations

import statistics
import threading
import time
import urllib.request
from dataclasses import dataclass

import grpc
import pytest

from conftest import SMALL_TILE_POLICY
from demo_data import indexed_demo
from packfeed.client import LocalServer, PackStream
from packfeed.server.index.table import read_index
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1 import packfeed_pb2_grpc as pb_grpc
from ports import free_port
from test_hostile import wait_for

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


@dataclass(frozen=True)
class Soak:
    """What one soak run saw: every rank's keys quiet and under attack, the waits, the attacker's counts, the
    server's memory (MiB) before, at the peak and after the hostile jobs were gone, and the budget still held."""

    valid: list[str]
    quiet_keys: dict[int, list[str]]
    keys: dict[int, list[str]]
    quiet_waits: list[float]
    waits: list[float]
    counts: dict[str, int]
    elapsed: float
    baseline_mib: float
    peak_mib: float
    after_mib: float
    held_bytes: float


def run_soak(tmp_path) -> Soak:
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
    return Soak(valid, quiet_keys, keys, quiet_waits, waits, counts, elapsed, baseline, peak, after, held)


def print_soak(soak: Soak) -> tuple[float, float]:
    """Prints the run's figures; returns the median step (compute + data wait) quiet and under attack, s."""
    quiet_step = COMPUTE_S + statistics.median(soak.quiet_waits)
    step = COMPUTE_S + statistics.median(soak.waits)
    print(f"\n[soak] {len(soak.valid)} samples x {EPOCHS} epochs, DP {DP}, {soak.counts['rounds']} hostile rounds "
          f"in {soak.elapsed:.1f} s: {soak.counts}")
    print(f"[soak] median step (compute {COMPUTE_S * 1e3:.0f} ms + data wait): quiet {quiet_step * 1e3:.1f} ms, "
          f"under attack {step * 1e3:.1f} ms ({step / quiet_step:.2f}x); p90 wait quiet "
          f"{statistics.quantiles(soak.quiet_waits, n=10)[-1] * 1e3:.1f} ms, under attack "
          f"{statistics.quantiles(soak.waits, n=10)[-1] * 1e3:.1f} ms")
    print(f"[soak] server + workers RSS: baseline {soak.baseline_mib:.0f} MiB, peak under attack "
          f"{soak.peak_mib:.0f} MiB, after the hostile jobs were closed or evicted {soak.after_mib:.0f} MiB; "
          f"budget held {soak.held_bytes:.0f} B")
    return quiet_step, step


def test_eight_ranks_stream_an_epoch_through_a_hostile_client(tmp_path):
    soak = run_soak(tmp_path)
    print_soak(soak)
    for ledger in (soak.quiet_keys, soak.keys):
        assert sorted(k for rank_keys in ledger.values() for k in rank_keys) == sorted(soak.valid * EPOCHS)
    assert soak.counts.get("INVALID_ARGUMENT", 0) > 0 and soak.counts.get("RESOURCE_EXHAUSTED", 0) > 0
    assert soak.held_bytes == 0  # every hostile job's reservation came back
