"""Redis losing its data changes nothing a rank receives: the servers serving a job register it again (a Redis
restarted empty, a replica promoted by Sentinel), a server over another index that registered the job id first
gives it up to the older registration, and every rank receives exactly its plan."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import grpc
import pytest
import redis as redis_py

from packfeed.client import LocalServer, PackStream
from packfeed.server.cluster.redis_coordinator import RedisCoordinator
from packfeed.server.index.config import IndexConfig
from packfeed.server.index.indexer import build_index
from packfeed.server.index.table import read_index_info
from packfeed.v1 import packfeed_pb2 as pb, packfeed_pb2_grpc as pb_grpc
from packfeed.v1.options import PlanConfig
from redis_server import RedisProcess, SentinelProcess
from ports import free_port
from test_service import step_digest, valid_keys

pytestmark = pytest.mark.slow
TTL = "2"  # lease TTL (s): jobs are re-asserted every min(1 s, TTL / 3)


def run_rank(targets, job, rank, dp, out, pace_s=0.0, started=None, epochs=1):
    """Consume the rank's whole job: (epoch, step, keys, digest, arrival time) per step."""
    records = out.setdefault(rank, [])
    with PackStream(targets, job=job, rank=rank, dp=dp, microbatches=1, prefetch=1, retries=12,
                    backoff=0.25, epochs=epochs) as stream:
        for step in stream:
            records.append((step.epoch, step.step, step.sample_keys, step_digest(step), time.monotonic()))
            if started is not None:
                started.set()
            time.sleep(pace_s)


def run_ranks(servers, job, dp, pace_s, disrupt, epochs=1) -> dict[int, list]:
    """Every rank in its own thread, rank r on server r % len(servers) first; `disrupt()` once a step arrived."""
    out: dict[int, list] = {}
    started = threading.Event()
    threads = [threading.Thread(target=run_rank, args=(
        [servers[(rank + k) % len(servers)].target for k in range(len(servers))], job, rank, dp, out, pace_s,
        started if rank == 0 else None, epochs)) for rank in range(dp)]
    for thread in threads:
        thread.start()
    assert started.wait(60)
    disrupt()
    for thread in threads:
        thread.join(240)
        assert not thread.is_alive(), "a rank did not finish"
    return out


def reference(index, job, dp, epochs=1) -> dict[int, list]:
    """Each rank's steps from one server alone, without Redis: the plan the shared job must deliver."""
    out: dict[int, list] = {}
    with LocalServer(index, workers=1) as server:
        for rank in range(dp):
            run_rank([server.target], job, rank, dp, out, epochs=epochs)
    return out


def assert_exactly_the_plan(received, expected, index, epochs=1) -> None:
    for rank in expected:
        assert [(e, s, d) for e, s, _, d, _ in received[rank]] == [(e, s, d) for e, s, _, d, _ in expected[rank]]
    for epoch in range(epochs):  # 0 lost, 0 repeated
        keys = [key for steps in received.values() for e, _, ks, _, _ in steps if e == epoch for key in ks]
        assert sorted(keys) == sorted(valid_keys(index))


def metric(port: int, name: str, **labels) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    wanted = ",".join(f'{key}="{value}"' for key, value in labels.items())
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + "{") and wanted in line)


def test_redis_restarted_empty_with_a_foreign_server_racing_to_open_the_job(tmp_path, dataset):
    """Mid-epoch Redis restarts empty, and while the job's own servers are held still (SIGSTOP) a server over
    another index opens the job first. Once they run again, they re-register it (the older registration wins),
    the foreign server gives it up, and both ranks receive exactly their plan."""
    info = read_index_info(dataset)
    other = tmp_path / "other.parquet"  # the same shards, indexed with other tiles: another plan
    build_index(info.inputs, other, IndexConfig(tokenizer=info.tokenizer["path"], image_policy={
        "name": "internvl", "image_size": 224, "max_num": 4}), workers=1, progress=False)
    expected = reference(dataset, "recover", 2)
    redis = RedisProcess(tmp_path / "redis").start()
    env = {"PACKFEED_REDIS_URL": redis.url, "PACKFEED_LEASE_TTL_S": TTL}
    ports = [free_port() for _ in range(3)]
    own = [LocalServer(dataset, workers=1, env=env, metrics_port=port).start() for port in ports[:2]]
    foreign = LocalServer(other, workers=1, env=env, metrics_port=ports[2]).start()
    opened = {}

    def restart_redis_empty_and_race():
        for server in own:
            os.kill(server.process.pid, signal.SIGSTOP)
        try:
            redis.kill()
            for path in (tmp_path / "redis").rglob("*"):
                if path.is_file():
                    path.unlink()  # its data gone
            redis.start()
            stub = pb_grpc.PackfeedStub(grpc.insecure_channel(foreign.target))
            opened["info"] = stub.OpenJob(pb.OpenJobRequest(job="recover", plan=PlanConfig(dp=2, microbatches=1)
                                                            .to_proto(), epochs=1), timeout=60)
        finally:
            for server in own:
                os.kill(server.process.pid, signal.SIGCONT)

    try:
        received = run_ranks(own, "recover", 2, 0.3, restart_redis_empty_and_race)
        record = RedisCoordinator(redis.url).job("recover")
        reclaimed = sum(metric(port, "packfeed_job_reassertions_total", job="recover", outcome="reclaimed")
                        for port in ports[:2])
        gave_up = metric(ports[2], "packfeed_job_reassertions_total", job="recover", outcome="gave_up")
        with pytest.raises(grpc.RpcError) as forgotten:  # the foreign server holds the job no more
            pb_grpc.PackfeedStub(grpc.insecure_channel(foreign.target)).GetJob(pb.GetJobRequest(job="recover"))
    finally:
        for server in (*own, foreign):
            server.stop()
        redis.stop()
    assert opened["info"].index_fingerprint != info.fingerprint  # the foreign server did take the job id first
    assert record is not None and record.index_fingerprint == info.fingerprint
    assert reclaimed >= 1 and gave_up == 1
    assert forgotten.value.code() == grpc.StatusCode.NOT_FOUND
    assert any("job registration conflict" in line for line in foreign.log)
    assert_exactly_the_plan(received, expected, dataset)


def test_a_sentinel_failover_mid_epoch_loses_and_repeats_nothing(tmp_path, dataset):
    """A master, its replica and a sentinel (real redis-server processes). Mid-epoch at DP 4 over 2 servers the
    master is killed; the sentinel promotes the replica, the servers follow it (redis+sentinel://) and every
    rank receives exactly its plan."""
    expected = reference(dataset, "sentinel", 4, epochs=6)  # long enough for the failover to land mid-job
    master = RedisProcess(tmp_path / "master").start()
    replica = RedisProcess(tmp_path / "replica", replica_of=master.port).start()
    deadline = time.monotonic() + 20
    while redis_py.Redis(port=replica.port).info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline, "the replica did not sync"
        time.sleep(0.1)
    sentinel = SentinelProcess(tmp_path / "sentinel", master.port).start()
    url = f"redis+sentinel://127.0.0.1:{sentinel.port}/{sentinel.service}"
    env = {"PACKFEED_REDIS_URL": url, "PACKFEED_LEASE_TTL_S": TTL}
    servers = [LocalServer(dataset, workers=1, env=env).start() for _ in range(2)]
    promoted_at = []

    def fail_over():  # the ranks stream on meanwhile
        master.kill()
        deadline = time.monotonic() + 60
        while sentinel.master_port_now() != replica.port:
            assert time.monotonic() < deadline, "the sentinel promoted no replica"
            time.sleep(0.1)
        promoted_at.append(time.monotonic())

    try:
        received = run_ranks(servers, "sentinel", 4, 0.3, fail_over, epochs=6)
        record = RedisCoordinator(url).job("sentinel")
    finally:
        for server in servers:
            server.stop()
        for process in (sentinel, replica, master):
            process.stop()
    assert record is not None and record.index_fingerprint == read_index_info(dataset).fingerprint
    assert any(arrived > promoted_at[0] for steps in received.values() for *_, arrived in steps)  # mid-job
    assert_exactly_the_plan(received, expected, dataset, epochs=6)
