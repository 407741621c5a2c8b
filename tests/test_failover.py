"""Several loader servers share a job through a real Redis: kill -9 one mid-epoch and every rank finishes
the epoch on another server, with no sample lost or repeated and the same bytes as a single server."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from packfeed.client import LocalServer, PackStream
from packfeed.client.stream.discovery import servers_from_redis
from packfeed.v1 import packfeed_pb2 as pb, packfeed_pb2_grpc as pb_grpc
from processes import descendants, workers
from redis_server import RedisProcess
from test_service import step_digest, valid_keys

pytestmark = pytest.mark.slow
DP, EPOCHS, TTL = 4, 2, "2"


def run_rank(targets, rank, out, pace_s=0.0, started=None):
    """Consume the rank's whole job; record (epoch, step, keys, digest, arrival time) per step."""
    records = out.setdefault(rank, [])
    with PackStream(targets, job="shared", rank=rank, dp=DP, microbatches=1, epochs=EPOCHS, prefetch=1,
                    retries=8, backoff=0.25) as stream:
        for step in stream:
            records.append((step.epoch, step.step, step.sample_keys, step_digest(step), time.monotonic()))
            if started is not None:
                started.set()
            time.sleep(pace_s)


def test_kill_one_of_three_servers_mid_epoch(tmp_path, dataset):
    redis = RedisProcess(tmp_path / "redis").start()
    env = {"PACKFEED_REDIS_URL": redis.url, "PACKFEED_LEASE_TTL_S": TTL}
    servers = [LocalServer(dataset, workers=1, env=env).start() for _ in range(3)]
    try:
        deadline = time.monotonic() + 10
        while len(servers_from_redis(redis.url)) < 3:  # every server announces itself in Redis
            assert time.monotonic() < deadline, "servers did not register in Redis"
            time.sleep(0.1)
        assert servers_from_redis(redis.url) == sorted(s.target for s in servers)

        reference: dict[int, list] = {}
        for rank in range(DP):  # one server alone, as the byte reference
            run_rank([servers[1].target], rank, reference)
        # now the shared job: rank r starts on server r % 3 and knows the others for failover
        shared: dict[int, list] = {}
        first_step = threading.Event()
        threads = [threading.Thread(target=run_rank, args=(
            [servers[(rank + k) % 3].target for k in range(3)], rank, shared, 0.3,
            first_step if rank == 0 else None)) for rank in range(DP)]
        for thread in threads:
            thread.start()
        assert first_step.wait(60)
        killed_at = time.monotonic()
        servers[0].process.kill()  # kill -9 of the server feeding ranks 0 and 3
        for thread in threads:
            thread.join(180)
            assert not thread.is_alive()
    finally:
        for server in servers:
            server.stop()
        redis.stop()

    for rank in range(DP):
        assert [(e, s, d) for e, s, _, d, _ in shared[rank]] == [(e, s, d) for e, s, _, d, _ in reference[rank]]
    for epoch in range(EPOCHS):  # the ledger: every valid sample exactly once per epoch, across ranks
        keys = [k for rank in range(DP) for e, _, ks, _, _ in shared[rank] if e == epoch for k in ks]
        assert sorted(keys) == sorted(valid_keys(dataset))
    gaps = [b[4] - a[4] for a, b in zip(shared[0], shared[0][1:]) if b[4] > killed_at]
    resume_s = max(gaps)
    print(f"\n[failover] rank 0 resumed on another server {resume_s:.1f} s after its previous step "
          f"(lease TTL {TTL} s)")
    assert resume_s < 30


def test_streams_go_on_while_redis_is_down_and_state_catches_up(tmp_path, dataset):
    """Redis killed mid-stream: the server keeps streaming what the deterministic plan says; when Redis is
    back (same data directory), the lease is held again and the acknowledged cursor catches up, forward only."""
    from packfeed.server.cluster.redis_coordinator import RedisCoordinator

    redis = RedisProcess(tmp_path / "redis").start()
    env = {"PACKFEED_REDIS_URL": redis.url, "PACKFEED_LEASE_TTL_S": "1.5"}
    with LocalServer(dataset, workers=1, env=env) as server:
        records: dict[int, list] = {}
        with PackStream(server.target, job="outage", rank=0, dp=1, microbatches=1, epochs=EPOCHS,
                        prefetch=1) as stream:
            steps = iter(stream)
            for _ in range(2):
                step = next(steps)
                records.setdefault(0, []).append(step.sample_keys)
            redis.kill()
            for _ in range(3):  # served on through the outage (leases renewed every 0.5 s fail meanwhile)
                records[0].append(next(steps).sample_keys)
                time.sleep(0.6)
            redis.start()
            for step in steps:
                records[0].append(step.sample_keys)
                last = (step.epoch, step.step)
        coordinator = RedisCoordinator(redis.url)
        deadline = time.monotonic() + 10
        while coordinator.acked("outage", 0) != last:
            assert time.monotonic() < deadline, f"acks did not catch up: {coordinator.acked('outage', 0)} != {last}"
            time.sleep(0.2)
    redis.stop()
    keys = [k for ks in records[0] for k in ks]
    assert sorted(keys) == sorted(valid_keys(dataset) * EPOCHS)


def test_a_server_over_another_index_cannot_capture_a_job_after_a_redis_flush(tmp_path, dataset):
    """Redis flushed, the job's server killed: a server over another index must refuse the clients that hold
    the job's plan (and register nothing), so the job's other server takes over and the epoch completes."""
    import redis as redis_client

    from packfeed.server.cluster.redis_coordinator import RedisCoordinator
    from packfeed.server.index.config import IndexConfig
    from packfeed.server.index.indexer import build_index
    from packfeed.server.index.table import read_index_info

    info = read_index_info(dataset)
    other = tmp_path / "other.parquet"  # the same shards, indexed with other tiles: another plan
    build_index(info.inputs, other, IndexConfig(tokenizer=info.tokenizer["path"], image_policy={
        "name": "internvl", "image_size": 224, "max_num": 4}), workers=1, progress=False)
    redis = RedisProcess(tmp_path / "redis").start()
    env = {"PACKFEED_REDIS_URL": redis.url, "PACKFEED_LEASE_TTL_S": TTL}
    own, stranger, spare = (LocalServer(index, workers=1, env=env).start() for index in (dataset, other, dataset))
    try:
        keys = []
        with PackStream([own.target, stranger.target, spare.target], job="captured", rank=0, dp=1,
                        microbatches=1, prefetch=1, retries=8, backoff=0.25) as stream:
            steps = iter(stream)
            keys += next(steps).sample_keys
            redis_client.Redis.from_url(redis.url).flushall()
            own.process.kill()
            for step in steps:
                keys += step.sample_keys
            fingerprint = stream.info.plan_fingerprint
        record = RedisCoordinator(redis.url).job("captured")
        assert record is not None and record.plan_fingerprint == fingerprint
        assert record.index_fingerprint == info.fingerprint
        stub = pb_grpc.PackfeedStub(grpc.insecure_channel(stranger.target))
        with pytest.raises(grpc.RpcError) as absent:  # refused, and no trace of the job left behind
            stub.GetJob(pb.GetJobRequest(job="captured"))
        assert absent.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        for server in (own, stranger, spare):
            server.stop()
        redis.stop()
    assert sorted(keys) == sorted(valid_keys(dataset))


def test_a_silent_server_is_left_for_another(dataset):
    """A server that stops answering mid-stream (SIGSTOP: a hung process, its connection still open) is given
    up after the client's stall timeout, and the epoch completes on the next server, exactly once."""
    import os
    import signal

    from packfeed.client import Connection

    hung, healthy = (LocalServer(dataset, workers=1).start() for _ in range(2))
    try:
        keys, gaps = [], []
        with PackStream([hung.target, healthy.target], job="silent", rank=0, dp=1, microbatches=1, prefetch=1,
                        connection=Connection(stall_timeout=3, retries=4, backoff=0.2)) as stream:
            steps = iter(stream)
            keys += next(steps).sample_keys
            os.kill(hung.process.pid, signal.SIGSTOP)
            last = time.monotonic()
            for step in steps:
                keys += step.sample_keys
                gaps.append(time.monotonic() - last)
                last = time.monotonic()
            assert stream.target == healthy.target
    finally:
        os.kill(hung.process.pid, signal.SIGCONT)
        hung.stop()
        healthy.stop()
    assert sorted(keys) == sorted(valid_keys(dataset))
    assert 2 < max(gaps) < 30  # the stall was noticed after about stall_timeout, not never


def test_a_killed_server_takes_its_pre_processing_workers_with_it(small_tile_index):
    """SIGKILL (or the OOM killer) gives a server no chance to stop its workers: the kernel stops them (Linux), so
    none lives on holding its memory."""
    import os
    import signal
    import sys

    if sys.platform != "linux":
        pytest.skip("parent-death signals are Linux's")
    server = LocalServer(small_tile_index, workers=2).start()
    try:
        with PackStream(server.target, job="orphans", rank=0, dp=1) as stream:
            next(iter(stream))  # the workers are running
        children = descendants(server.process.pid)  # the resource tracker, the fork server, its workers
        assert len(workers(server.process.pid)) == 2 and len(children) >= 4
    finally:
        os.kill(server.process.pid, signal.SIGKILL)
        server.process.wait(10)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in children):
        time.sleep(0.1)
    alive = [pid for pid in children if os.path.exists(f"/proc/{pid}")]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive


def metric(port: int, name: str, **labels: str) -> float:
    """The sum of a metric's series (those with `labels`) on a server's /metrics."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in " {" and all(w in line for w in wanted))


def test_while_redis_is_down_no_second_stream_of_a_rank_starts(tmp_path, dataset):
    """Fail-closed exclusivity: rank 0 streams from server A; Redis is killed; a second consumer of rank 0 on
    server B is refused (UNAVAILABLE, saying why) and receives nothing, while A's stream goes on. Both are
    counted: B's refusal, A's renewals that could not reach Redis. With Redis back, B serves the rank's next
    consumer again once A lets the lease go."""
    from ports import free_port
    from packfeed.client import Connection, PackfeedError

    redis = RedisProcess(tmp_path / "redis").start()
    env = {"PACKFEED_REDIS_URL": redis.url, "PACKFEED_LEASE_TTL_S": "1.5"}
    ports = [free_port(), free_port()]
    a, b = (LocalServer(dataset, workers=1, env=env, metrics_port=port).start() for port in ports)
    job = dict(job="exclusive", dp=2, microbatches=1, epochs=EPOCHS, prefetch=1)
    try:
        with PackStream(a.target, rank=0, **job) as trainer, \
                PackStream(b.target, rank=0, connection=Connection(retries=0), **job) as second:
            steps = iter(trainer)
            received = [next(steps).sample_keys]
            redis.kill()
            time.sleep(1.0)  # at least one renewal of A's lease fails meanwhile
            with pytest.raises(PackfeedError, match="cannot reach the coordinator") as refused:
                next(iter(second))  # the job is open on B (registered while Redis was up): its stream is refused
            assert refused.value.code == grpc.StatusCode.UNAVAILABLE
            for _ in range(3):  # the running stream goes on through the outage
                received.append(next(steps).sample_keys)
            assert metric(ports[1], "packfeed_stream_refusals_total", lease="unreachable") >= 1
            assert metric(ports[0], "packfeed_lease_renewals_unchecked_total", job="exclusive") >= 1
            redis.start()
            received += [step.sample_keys for step in steps]
        assert len({key for keys in received for key in keys}) > 0
        with PackStream(b.target, rank=0, **job) as after:  # A let go: B serves the rank again
            assert next(iter(after)).sample_keys == received[0]
    finally:
        a.stop()
        b.stop()
        redis.stop()


def test_calls_racing_another_threads_failover_reach_a_server(dataset):
    """A stream's receiver fails over (closing the old channel) while the trainer's thread acknowledges and a
    producer's heartbeat calls on the same channel: grpc refuses a call on the closed channel with a ValueError,
    which reached the caller (a trainer or producer thread died of it). Now the call goes to the server moved to."""
    from packfeed.client import Connection
    from packfeed.client.stream.channel import PackfeedError, ServerChannel

    servers = [LocalServer(dataset, workers=1).start() for _ in range(2)]
    try:
        # 200 fail-overs, and more retries than that: no call can run out of them, however slow the machine
        channel = ServerChannel([s.target for s in servers], Connection(token="", retries=250, backoff=0.0))
        flips, failures, answered = threading.Event(), [], []

        def flip() -> None:
            for _ in range(200):
                if flips.wait(0.002):
                    return
                channel.fail_over()

        flipper = threading.Thread(target=flip)
        flipper.start()
        try:
            for _ in range(400):
                try:
                    answered.append(channel.call("ListJobs", pb.ListJobsRequest()))
                    channel.send("ListJobs", pb.ListJobsRequest())
                except Exception as error:  # noqa: BLE001 (what the caller would have died of)
                    failures.append(repr(error))
                try:
                    channel.ask("ListJobs", pb.ListJobsRequest())
                except PackfeedError as error:  # ask does not retry: a moved channel is UNAVAILABLE, said so
                    if error.code is not grpc.StatusCode.UNAVAILABLE:
                        failures.append(repr(error))
                except Exception as error:  # noqa: BLE001
                    failures.append(repr(error))
        finally:
            flips.set()
            flipper.join(30)
        assert not failures and len(answered) == 400, failures[:3]
    finally:
        for server in servers:
            server.stop()


def test_retries_back_off_doubling_up_to_max_backoff():
    from packfeed.client import Connection

    connection = Connection(token="", backoff=0.2, max_backoff=10.0)
    assert [connection.delay(k) for k in range(8)] == pytest.approx([0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0])
    assert Connection(token="").delay(1000) == 10.0  # 5 retries of 0.5 s doubling by default: 0.5 ... 8 s
    with pytest.raises(ValueError, match="max_backoff must be >= 0"):
        Connection(token="", max_backoff=-1)
