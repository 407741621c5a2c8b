"""What a put costs the server in memory: the peak growth of the server process's resident memory during one put,
per MiB put, for puts of 16 to 128 MiB (the goal: within 2x the put's size).

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_put_memory.py -m benchmark

Workload: `packfeed serve --live-spool` (1 worker) on loopback, a live job opened by its producer
(`Producer(plan=...)`); each put holds samples of 256K tokens with a loss mask and two float32 tensors per token
(3.25 MiB a sample on the wire). Before each put the server's peak RSS is reset (`/proc/PID/clear_refs` 5, Linux, as
root); after it, the peak (VmHWM) minus the RSS before is the put's cost. The workers take no part in a put (their
RSS is printed, unchanged). Three rounds per size, each with new ids; the median and the range per MiB.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.benchmark
TOKENS, ROUNDS = 256 * 1024, 3


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def samples(count: int, tag: str) -> list[dict]:
    rng = np.random.default_rng(len(tag))
    return [{"id": f"{tag}-{k}", "tokens": rng.integers(100, 800, TOKENS).astype(np.int32),
             "loss_mask": (np.arange(TOKENS) >= 64).astype(np.uint8),
             "tensors": {"advantages": rng.normal(size=TOKENS).astype(np.float32),
                         "old_logprobs": rng.normal(size=TOKENS).astype(np.float32)}} for k in range(count)]


def test_put_memory_per_mib(tmp_path):
    from demo_data import indexed_demo
    from packfeed.client import Connection, LocalServer, PlanConfig, Producer

    if os.geteuid() != 0:
        pytest.skip("resetting a process's peak RSS (/proc/PID/clear_refs) needs root")
    _, index = indexed_demo(tmp_path / "demo", 12, 1, 5)
    plan = PlanConfig(dp=1, microbatches=1, live=True, step_samples=10_000, token_cap=TOKENS, vision_cap=64)
    rows = []
    with LocalServer(index, workers=1, extra_args=["--live-spool", str(tmp_path / "spool")]) as server:
        pid = server.process.pid
        with Producer(server.target, job="memory", plan=plan, batch_samples=1 << 20, batch_bytes=1 << 40,
                      connection=Connection(max_message_mb=256, timeout=600)) as producer:
            producer.put(samples(1, "warm"))  # the job opened, its first batch written: what every put pays once
            for mib in (16, 64, 128):
                count = max(1, round(mib * 2**20 / (TOKENS * 13)))
                ratios = []
                for round_ in range(ROUNDS):
                    batch = samples(count, f"{mib}-{round_}")
                    wire = sum(s["tokens"].nbytes + s["loss_mask"].nbytes + sum(t.nbytes for t in s["tensors"].values())
                               for s in batch)
                    Path(f"/proc/{pid}/clear_refs").write_text("5")
                    before = status_kib(pid, "VmRSS")
                    producer.put(batch)
                    peak = status_kib(pid, "VmHWM")
                    ratios.append((peak - before) * 1024 / wire)
                rows.append({"put_mib": round(wire / 2**20, 1), "samples": count,
                             "peak_growth_per_mib_median": round(float(np.median(ratios)), 2),
                             "range": [round(min(ratios), 2), round(max(ratios), 2)]})
        workers = [int(p) for p in os.popen(f"pgrep -P {pid}").read().split()]
        rows.append({"server_rss_mib": round(status_kib(pid, "VmRSS") / 1024, 1),
                     "workers_rss_mib": [round(status_kib(w, "VmRSS") / 1024, 1) for w in workers]})
    print(json.dumps(rows, indent=1))
    assert all(row["peak_growth_per_mib_median"] > 0 for row in rows[:-1])
