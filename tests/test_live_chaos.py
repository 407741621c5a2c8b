"""A live job under chaos, judged by its ledger alone: two `packfeed serve` processes share a spool (a real 8 MiB
tmpfs where the test runs as root) and a real Redis; two producers put rollouts through both servers, retrying each
put until it returns, while two trainer ranks stream the job, each reopening its stream from its last state when
it fails. Meanwhile, at seeded random times, the holder or the standby is killed -9 and restarted on its port, and
the spool's disk is filled to the last byte for a moment. Every sample whose put returned (acknowledged) must be
delivered exactly once, and nothing never put is delivered."""

from __future__ import annotations

import collections
import json
import random
import subprocess
import threading
import time

import numpy as np
import pytest

from ports import free_port
from packfeed.client import Connection, LocalServer, PackfeedError, PackStream, PlanConfig, Producer

pytestmark = pytest.mark.slow
PLAN = PlanConfig(dp=2, microbatches=1, live=True, step_samples=8)
CONNECTION = Connection(retries=12, backoff=0.2, timeout=20.0, stall_timeout=30.0)
PRODUCERS, PER_PRODUCER, PUT = 2, 64, 4


def rollouts(producer: int) -> list[dict]:
    rng = np.random.default_rng(producer)
    out = []
    for number in range(PER_PRODUCER):
        n = int(rng.integers(20, 120))
        out.append({"id": f"p{producer}-{number}", "tokens": rng.integers(100, 800, n).astype(np.int32),
                    "loss_mask": (np.arange(n) >= 5).astype(np.uint8), "group": f"p{producer}-{number}",
                    "tensors": {"advantages": rng.normal(size=n).astype(np.float32)}})
    return out


class Servers:
    """Two servers on fixed ports (a restart keeps the address the clients know)."""

    def __init__(self, index, spool, env):
        self.ports = [free_port(), free_port()]
        self.index, self.spool, self.env = index, spool, env
        self.running = [self._start(k) for k in range(2)]

    def _start(self, k: int) -> LocalServer:
        return LocalServer(self.index, workers=1, env=self.env, extra_args=[
            "--live-spool", str(self.spool), "--listen", f"127.0.0.1:{self.ports[k]}"]).start()

    @property
    def targets(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.ports]

    def kill_and_restart(self, k: int, down_s: float) -> None:
        self.running[k].process.kill()
        self.running[k].process.wait()
        time.sleep(down_s)
        self.running[k] = self._start(k)

    def stop(self) -> None:
        for server in self.running:
            server.stop()


def produce(targets: list[str], producer: int, acknowledged: set, stop: threading.Event) -> None:
    samples, pause = rollouts(producer), random.Random(producer)
    with Producer(targets, job="chaos", connection=CONNECTION, open_wait_s=120, full_wait_s=120,
                  on_refused="return") as client:
        for start in range(0, len(samples), PUT):
            batch = samples[start:start + PUT]
            while not stop.is_set():  # a producer retries its put until it returns: the same ids, stored once
                try:
                    results = client.put(batch)
                except PackfeedError:
                    time.sleep(0.3)
                    continue
                acknowledged.update(r.id for r in results if r.accepted)
                break
            time.sleep(pause.uniform(0.2, 1.2))  # rollouts take their time: the chaos meets puts in flight


def train(targets: list[str], rank: int, delivered: list, errors: list, stop: threading.Event) -> None:
    state, ended = None, False
    while not ended and not stop.is_set():
        try:
            with PackStream(targets, job="chaos", rank=rank, plan=PLAN, connection=CONNECTION, prefetch=1) as stream:
                if state is not None:
                    stream.load_state_dict(state)
                for step in stream:
                    delivered.extend(step.sample_keys)
                    state = stream.state_dict()
                ended = True
        except PackfeedError as error:  # the trainer reopens its stream where it left off
            errors.append(str(error)[:200])
            time.sleep(0.5)


def fill(disk, hold_s: float) -> None:
    """The disk full to its last byte for `hold_s` seconds, then freed."""
    import os

    filler = disk / "filler"
    stats = os.statvfs(disk)
    try:
        with open(filler, "wb") as out:
            out.write(b"\0" * (stats.f_bavail * stats.f_frsize))
            while True:  # what the page rounding left
                out.write(b"\0" * 4096)
                out.flush()
    except OSError:
        pass
    time.sleep(hold_s)
    filler.unlink(missing_ok=True)


def test_a_live_job_under_kills_and_full_disks_delivers_every_acknowledged_sample_once(small_tile_index, tmp_path):
    from redis_server import RedisProcess

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)],
                             capture_output=True).returncode == 0
    redis = RedisProcess(tmp_path / "redis").start()
    env = {"PACKFEED_AUTH_TOKEN": "", "PACKFEED_REDIS_URL": redis.url, "PACKFEED_LEASE_TTL_S": "2"}
    servers = Servers(small_tile_index, disk / "spool", env)
    rng, events = random.Random(72), collections.Counter()
    acknowledged, delivered, errors = set(), [[], []], [[], []]
    stop = threading.Event()
    try:
        targets = servers.targets
        ranks = [threading.Thread(target=train, args=(targets[::1 - 2 * r], r, delivered[r], errors[r], stop))
                 for r in range(2)]
        producers = [threading.Thread(target=produce, args=(targets, p, acknowledged, stop))
                     for p in range(PRODUCERS)]
        for thread in ranks + producers:
            thread.start()
        deadline = time.monotonic() + 240
        while any(p.is_alive() for p in producers) and time.monotonic() < deadline:
            time.sleep(rng.uniform(0.5, 2.0))
            if mounted and rng.random() < 0.4:
                fill(disk, rng.uniform(0.3, 1.5))
                events["disk full"] += 1
            else:
                k = rng.randrange(2)
                servers.kill_and_restart(k, rng.uniform(0.2, 1.5))
                events[f"kill -9 server {k}"] += 1
        for thread in producers:
            thread.join(120)
        ended = False
        with Producer(targets, job="chaos", connection=CONNECTION) as closer:
            for _ in range(60):
                try:
                    closer.end()
                    ended = True
                    break
                except PackfeedError as error:
                    if "ended at step" in str(error):  # an earlier end landed, its answer lost
                        ended = True
                        break
                    time.sleep(0.5)
        ended_at = time.monotonic()
        for thread in ranks:
            thread.join(max(1.0, ended_at + 180 - time.monotonic()))
        still_streaming = [r for r, thread in enumerate(ranks) if thread.is_alive()]
    finally:
        stop.set()
        servers.stop()
        redis.stop()
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], check=False)
    counts = collections.Counter(delivered[0] + delivered[1])
    put = {s["id"] for p in range(PRODUCERS) for s in rollouts(p)}
    ledger = {"events": dict(events), "acknowledged": len(acknowledged), "delivered": len(counts),
              "lost": len(acknowledged - set(counts)), "repeated": sum(c - 1 for c in counts.values() if c > 1),
              "never_put": len(set(counts) - put), "stream_reopens": [len(e) for e in errors], "ended": ended,
              "still_streaming": still_streaming, "last_errors": [e[-2:] for e in errors]}
    print("live chaos ledger:", json.dumps(ledger))
    assert ledger["lost"] == ledger["repeated"] == ledger["never_put"] == 0 and ended, ledger
