"""Chaos soak: for a bounded time, at random (seeded), kill -9 a loader server (restarted on its port), fail the
Redis master over (Sentinel), cancel a rank's stream mid-step (it resumes from its state_dict), and change a
shard in the object store, while the store itself throttles (503, 429, dropped connections on every few
requests). DP 4 ranks stream a job over 3 servers. Reported: steps served, samples lost (neither delivered nor
reported skipped) and repeated (0 and 0 is the goal), the skips reported with their reasons, and each server
tree's peak memory (PSS) against its memory budget.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_chaos.py -m benchmark
(PACKFEED_CHAOS_S: seconds of chaos, default 90; PACKFEED_CHAOS_SEED: the events' seed, default 0;
PACKFEED_CHAOS_EPOCHS: the job's epochs, default 10)
"""

from __future__ import annotations

import collections
import io
import os
import random
import tarfile
import threading
import time
from pathlib import Path

import pytest

from packfeed.client import LocalServer, PackStream
from packfeed.server.index.indexer import build_index
from packfeed.server.index.table import read_index
from ports import free_port
from redis_server import RedisProcess, SentinelProcess
from s3_server import FaultyProxy, S3Server, restore_env, set_env
from test_object_storage import index_config, upload
from test_sample_limits import tree_pss

pytestmark = pytest.mark.benchmark
DP, SERVERS, BUDGET_MB = 4, 3, 256
EPOCHS = int(os.environ.get("PACKFEED_CHAOS_EPOCHS", "10"))
MiB = 1 << 20


class Rank(threading.Thread):
    """One rank consuming the whole job; `cancel()` closes its stream mid-step, and it resumes from its state."""

    def __init__(self, rank: int, targets: list[str]):
        super().__init__(daemon=True)
        self.rank, self.targets = rank, targets
        self.steps: list[tuple[int, int, list[str], list[tuple[str, str]]]] = []
        self.cancels, self._cancel, self.error = 0, threading.Event(), None

    def cancel(self) -> None:
        self._cancel.set()

    def run(self) -> None:
        state = None
        try:
            while True:
                with PackStream(self.targets, job="chaos", rank=self.rank, dp=DP, microbatches=1, epochs=EPOCHS,
                                prefetch=2, retries=30, backoff=0.25) as stream:
                    if state is not None:
                        stream.load_state_dict(state)
                    for step in stream:
                        self.steps.append((step.epoch, step.step, list(step.sample_keys),
                                           [tuple(s) for pack in step.packs for s in pack.skipped]))
                        if self._cancel.is_set():  # mid-job: the stream is closed with steps in flight
                            self._cancel.clear()
                            self.cancels += 1
                            state = stream.state_dict()
                            break
                        time.sleep(0.1)  # a trainer's step
                    else:
                        return
        except BaseException as error:  # reported by the test
            self.error = error


def changed_shard(shard: Path, out: Path) -> Path:
    """The shard with its first two samples' JSON swapped: same size and layout, other content."""
    with tarfile.open(shard) as tar:
        members = [(member, tar.extractfile(member).read()) for member in tar]
    jsons = [k for k, (member, _) in enumerate(members) if member.name.endswith(".json")][:2]
    (a, data_a), (b, data_b) = members[jsons[0]], members[jsons[1]]
    if len(data_a) == len(data_b):
        data_b = data_b[::-1]
    members[jsons[0]], members[jsons[1]] = (a, data_b), (b, data_a)
    with tarfile.open(out, "w", format=tarfile.USTAR_FORMAT) as tar:
        for member, data in members:
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return out


def compete_for_a_rank(targets: list[str], rank: int) -> tuple[int, int]:
    """A second consumer asks every server for `rank` of the chaos job while Redis is down: (attempts refused,
    samples it received). Fail-closed exclusivity says 0 received: the rank is being streamed elsewhere."""
    from packfeed.client import Connection, PackfeedError

    refused = received = 0
    for target in targets:
        try:
            with PackStream(target, job="chaos", rank=rank, dp=DP, microbatches=1, epochs=EPOCHS, prefetch=1,
                            acknowledge=False, connection=Connection(retries=0, timeout=10)) as competitor:
                received += len(next(iter(competitor)).sample_keys)
        except PackfeedError:
            refused += 1
    return refused, received


def redis_outage(redis_nodes: dict, sentinel, targets: list[str], rng: random.Random) -> tuple[int, int]:
    """Every Redis node killed for a few seconds while the ranks stream and a competing consumer asks for one of
    their ranks; then back on their ports and data (the master as it was, the other its replica)."""
    master = sentinel.master_port_now()
    for node in redis_nodes.values():
        node.kill()
    time.sleep(1.0)  # the servers' lease renewals fail meanwhile
    refused, received = compete_for_a_rank(targets, rng.randrange(DP))
    time.sleep(rng.uniform(0.5, 2.0))
    for port, node in list(redis_nodes.items()):
        redis_nodes[port] = RedisProcess(node.directory, port=port, replica_of=None if port == master else master)
    redis_nodes[master].start()
    for port, node in redis_nodes.items():
        if port != master:
            node.start()
    return refused, received


def elastic_resume(tmp_path: Path, demo_dataset, targets: list[str], env: dict, valid: set[str]) -> dict:
    """A DP 4 job stops after 2 steps; a resume at DP 2 from its honest states over an index that lost a shard is
    refused, and over the job's own index delivers the rest of the epoch: (refused, lost, repeated)."""
    from concurrent.futures import ThreadPoolExecutor

    from packfeed.client import PackfeedError

    old = dict(job="chaos-elastic", dp=DP, microbatches=1, epochs=1, retries=30, backoff=0.25)

    def first_steps(rank: int) -> tuple[list, list, dict]:
        with PackStream(targets[rank % len(targets)], rank=rank, **old) as stream:
            steps = [next(stream) for _ in range(2)]
            return ([k for step in steps for k in step.sample_keys],
                    [s for step in steps for pack in step.packs for s in pack.skipped], stream.state_dict())

    with ThreadPoolExecutor(DP) as pool:
        done = list(pool.map(first_steps, range(DP)))
    states = [state for _, _, state in done]
    shrunk = tmp_path / "shrunk.parquet"
    # the same shards but the last (local copies: the store's throttling is not what is tested here)
    build_index([str(shard) for shard in demo_dataset.shards[:-1]], shrunk, index_config(demo_dataset), workers=1,
                progress=False)
    new = dict(job="chaos-resumed", dp=2, microbatches=1, epochs=1, retries=30, backoff=0.25, resume=states)
    refused = 0
    with LocalServer(shrunk, workers=1, env={k: v for k, v in env.items() if k != "PACKFEED_REDIS_URL"}) as other:
        try:
            PackStream(other.target, rank=0, **new).close()
        except PackfeedError as error:
            refused += "FAILED_PRECONDITION" in str(error) and "what differs: the index" in str(error)

    def rest(rank: int) -> tuple[list, list]:
        with PackStream(targets[rank % len(targets)], rank=rank, **new) as stream:
            steps = list(stream)
        return ([k for step in steps for k in step.sample_keys],
                [s for step in steps for pack in step.packs for s in pack.skipped])

    with ThreadPoolExecutor(2) as pool:
        done += [(keys, skips, None) for keys, skips in pool.map(rest, range(2))]
    delivered = collections.Counter(key for keys, _, _ in done for key in keys)
    reported = {key for _, skips, _ in done for key, _ in skips}
    return {"refused": refused, "lost": len(valid - set(delivered) - reported),
            "repeated": sum(count - 1 for count in delivered.values() if count > 1)}


def test_chaos_soak(tmp_path, demo_dataset):
    chaos_s = float(os.environ.get("PACKFEED_CHAOS_S", "90"))
    rng = random.Random(int(os.environ.get("PACKFEED_CHAOS_SEED", "0")))
    s3 = S3Server().start()
    proxy = FaultyProxy(s3.endpoint, tmp_path, every=7, delay_ms=2).start()  # a throttling, flaky store
    previous = set_env(proxy.env)
    master = RedisProcess(tmp_path / "redis-a").start()
    replica = RedisProcess(tmp_path / "redis-b", replica_of=master.port).start()
    sentinel = SentinelProcess(tmp_path / "sentinel", master.port).start()
    redis_nodes = {master.port: master, replica.port: replica}
    env = {**proxy.env, "PACKFEED_REDIS_URL": f"redis+sentinel://127.0.0.1:{sentinel.port}/{sentinel.service}",
           "PACKFEED_LEASE_TTL_S": "2", "PACKFEED_MEMORY_BUDGET_MB": str(BUDGET_MB),
           "PACKFEED_MAX_SKIPPED_FRACTION": "1"}  # a step of the changed shard's samples goes out, reported
    ports = [free_port() for _ in range(SERVERS)]
    servers: list[LocalServer | None] = [None] * SERVERS
    events: collections.Counter = collections.Counter()
    competitors: collections.Counter = collections.Counter()  # a second consumer of a streamed rank, Redis down
    peaks = [0] * SERVERS
    try:
        upload(s3, demo_dataset.shards, "chaos/demo")
        index = tmp_path / "index.parquet"
        build_index(["s3://chaos/demo/*.tar"], index, index_config(demo_dataset), workers=1, progress=False)
        rows = read_index(index, ["key", "valid", "shard"])[0].to_pylist()
        valid = {row["key"] for row in rows if row["valid"]}

        def start(k: int) -> None:
            servers[k] = LocalServer(index, workers=1, env=env, extra_args=["--listen", f"127.0.0.1:{ports[k]}"]).start()

        for k in range(SERVERS):
            start(k)
        targets = [f"127.0.0.1:{port}" for port in ports]
        ranks = [Rank(r, targets[r % SERVERS:] + targets[:r % SERVERS]) for r in range(DP)]
        started = time.monotonic()
        for rank in ranks:
            rank.start()
        changed = False
        while time.monotonic() - started < chaos_s and any(rank.is_alive() for rank in ranks):
            deadline = time.monotonic() + rng.uniform(2, 5)
            while time.monotonic() < deadline:  # memory sampled meanwhile
                for k, server in enumerate(servers):
                    if server is not None:
                        peaks[k] = max(peaks[k], tree_pss(server.process.pid))
                time.sleep(0.2)
            event = rng.choice(["kill server", "fail redis over", "cancel a client", "change a shard",
                                "redis outage"])
            if event == "kill server":
                k = rng.randrange(SERVERS)
                servers[k].process.kill()
                servers[k].stop()
                start(k)  # back on its port, as an orchestrator restarts it
            elif event == "fail redis over":
                old = sentinel.master_port_now()
                redis_nodes[old].kill()
                wait = time.monotonic() + 30
                while sentinel.master_port_now() == old:
                    assert time.monotonic() < wait, "the sentinel promoted no replica"
                    time.sleep(0.2)
                new = sentinel.master_port_now()
                redis_nodes[old] = RedisProcess(redis_nodes[old].directory, port=old, replica_of=new).start()
            elif event == "redis outage":
                refused, received = redis_outage(redis_nodes, sentinel, targets, rng)
                competitors["refused"] += refused
                competitors["received"] += received
            elif event == "cancel a client":
                rng.choice(ranks).cancel()
            elif not changed:
                shard = demo_dataset.shards[rng.randrange(len(demo_dataset.shards))]
                import s3fs

                s3fs.S3FileSystem(endpoint_url=s3.endpoint, skip_instance_cache=True).put_file(
                    str(changed_shard(shard, tmp_path / shard.name)), f"s3://chaos/demo/{shard.name}")
                changed = True
            else:
                continue
            events[event] += 1
        chaos_seconds = time.monotonic() - started
        for rank in ranks:
            rank.join(600)
        faults = proxy.count()
        resumed = elastic_resume(tmp_path, demo_dataset, targets, env, valid)
    finally:
        for server in servers:
            if server is not None:
                server.stop()
        for process in (sentinel, *redis_nodes.values()):
            process.stop()
        restore_env(previous)
        proxy.stop()
        s3.stop()

    assert not [rank.error for rank in ranks if rank.error], [repr(rank.error) for rank in ranks if rank.error]
    steps = sum(len(rank.steps) for rank in ranks)
    lost = repeated = 0
    skipped: collections.Counter = collections.Counter()
    examples: dict[str, str] = {}
    for epoch in range(EPOCHS):
        delivered = collections.Counter(key for rank in ranks for e, _, keys, _ in rank.steps if e == epoch
                                        for key in keys)
        reported = {key: reason for rank in ranks for e, _, _, skips in rank.steps if e == epoch
                    for key, reason in skips}
        skipped.update(reason.split(":")[0] for reason in reported.values())
        examples.update({reason.split(":")[0]: f"{key}: {reason}" for key, reason in reported.items()})
        repeated += sum(count - 1 for count in delivered.values() if count > 1)
        lost += len(valid - set(delivered) - set(reported))
    for rank in ranks:  # every rank's steps once each, in order
        positions = [(e, s) for e, s, _, _ in rank.steps]
        assert positions == sorted(set(positions)), f"rank {rank.rank} got steps twice or out of order"
    print(f"\n[chaos] {chaos_seconds:.0f} s of chaos, DP {DP}, {SERVERS} servers, {EPOCHS} epochs of "
          f"{len(valid)} samples: events {dict(events)}, client cancels {sum(r.cancels for r in ranks)}, "
          f"store faults {faults}")
    print(f"[chaos] steps served {steps}; samples lost {lost}, repeated {repeated}; reported skips "
          f"{dict(skipped)}, e.g. {sorted(examples.values())}")
    print(f"[chaos] peak PSS per server tree (server + 1 worker): "
          f"{', '.join(f'{p / MiB:.0f}' for p in peaks)} MiB against a budget of {BUDGET_MB} MiB")
    print(f"[chaos] a competing consumer while Redis was down: {competitors['refused']} attempts refused, "
          f"{competitors['received']} samples received")
    print(f"[chaos] resume over an index that lost a shard: {resumed['refused']} of 1 refused; the honest resume "
          f"at DP 2: samples lost {resumed['lost']}, repeated {resumed['repeated']}")
    assert lost == 0 and repeated == 0
    assert competitors["received"] == 0 and resumed == {"refused": 1, "lost": 0, "repeated": 0}
    assert sum(events.values()) >= 3
