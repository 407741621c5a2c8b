"""Coordination state, embedded and in a real redis-server (started, killed with -9 and restarted here)."""

from __future__ import annotations

import time

import pytest
from packfeed.server.cluster.coordinator import (
    CoordinationError,
    CoordinationUnavailable,
    EmbeddedCoordinator,
    JobRecord,
    Reassertion,
)
from dataclasses import replace
from packfeed.server.cluster.redis_coordinator import RedisCoordinator
from redis_server import RedisProcess

RECORD = JobRecord(spec='{"plan": "a"}', plan_fingerprint="p1", index_fingerprint="i1")


@pytest.fixture
def redis_process(tmp_path):
    process = RedisProcess(tmp_path / "redis").start()
    yield process
    process.stop()


@pytest.fixture(params=["embedded", "redis"])
def coordinator(request, tmp_path):
    if request.param == "embedded":
        yield EmbeddedCoordinator()
        return
    process = RedisProcess(tmp_path / "redis", password="s3cret").start()
    yield RedisCoordinator(process.url, password="s3cret")
    process.stop()


def test_a_job_is_registered_once_and_a_different_fingerprint_is_refused(coordinator):
    assert coordinator.register_job("j", RECORD) == RECORD
    assert coordinator.register_job("j", RECORD) == RECORD  # another server, same plan: joins
    other = JobRecord(RECORD.spec, "p2", RECORD.index_fingerprint)
    with pytest.raises(CoordinationError) as refused:
        coordinator.register_job("j", other)
    assert refused.value.code == "FAILED_PRECONDITION" and "p2" in str(refused.value)
    assert coordinator.job("j") == RECORD and coordinator.job("nope") is None


def test_a_job_reasserted_after_data_loss_is_restored_and_the_older_registration_wins(coordinator):
    """What servers serving a job do every second: restore a record the coordinator lost, keep an equal one
    (a joining server's, registered later, is the same job), take the id back from a younger registration of
    another plan, and give it up to an older one."""
    ours = replace(RECORD, registered_ms=1_000)
    assert coordinator.reassert_job("j", ours) == (Reassertion.RESTORED, None)  # nothing there: restored
    assert coordinator.job("j") == ours
    assert coordinator.register_job("j", replace(RECORD, registered_ms=5_000)) == ours  # a later joiner adopts it
    assert coordinator.reassert_job("j", ours) == (Reassertion.HELD, ours)
    younger = JobRecord(RECORD.spec, "foreign", "other-index", registered_ms=2_000)
    if isinstance(coordinator, EmbeddedCoordinator):
        coordinator._jobs["j"] = younger  # as if the data were lost and another index registered the id first
    else:
        coordinator.client.flushall()
        coordinator.register_job("j", younger)
    assert coordinator.reassert_job("j", ours) == (Reassertion.RECLAIMED, younger)
    assert coordinator.job("j") == ours
    with pytest.raises(CoordinationError) as older:  # the younger one must give the id up
        coordinator.reassert_job("j", younger)
    assert older.value.code == "FAILED_PRECONDITION" and "foreign" in str(older.value)
    assert coordinator.job("j") == ours


def test_leases_are_exclusive_renewable_and_expire(coordinator):
    assert coordinator.acquire_lease("j", 0, "server-a", ttl_s=0.5)
    assert not coordinator.acquire_lease("j", 0, "server-b", ttl_s=0.5)
    assert coordinator.acquire_lease("j", 1, "server-b", ttl_s=0.5)  # another rank is free
    assert coordinator.acquire_lease("j", 0, "server-a", ttl_s=0.5)  # renewed by its holder
    assert not coordinator.acquire_lease("j", 0, "server-b", ttl_s=0.5)
    assert coordinator.lease_owner("j", 0) == "server-a"
    time.sleep(0.8)  # server-a stopped heartbeating: its lease lapses and another server takes the rank
    assert coordinator.lease_owner("j", 0) is None
    assert coordinator.acquire_lease("j", 0, "server-b", ttl_s=5)
    assert not coordinator.release_lease("j", 0, "server-a")
    assert coordinator.release_lease("j", 0, "server-b") and coordinator.lease_owner("j", 0) is None


def test_acknowledged_steps_never_go_backwards(coordinator):
    assert coordinator.acked("j", 0) is None
    assert coordinator.ack("j", 0, 0, 5) == (0, 5)
    assert coordinator.ack("j", 0, 0, 3) == (0, 5)  # a late ack from a slow connection
    assert coordinator.ack("j", 0, 1, 0) == (1, 0)  # the next epoch orders after every step of this one
    assert coordinator.ack("j", 0, 0, 9) == (1, 0)
    assert coordinator.acked("j", 0) == (1, 0) and coordinator.acked("j", 1) is None


def test_skipped_samples(coordinator):
    coordinator.add_skipped("j", "shard-0/key-7", "image does not decode")
    assert coordinator.skipped("j") == {"shard-0/key-7": "image does not decode"}


def test_live_servers_are_what_clients_find_in_redis(redis_process):
    """Servers announce themselves with a TTL; clients list the live ones (servers_from_redis)."""
    from packfeed.client.stream.discovery import servers_from_redis

    coordinator = RedisCoordinator(redis_process.url)
    coordinator.heartbeat_server("10.0.0.1:50051", ttl_s=0.4)
    coordinator.heartbeat_server("10.0.0.2:50051", ttl_s=5)
    assert servers_from_redis(redis_process.url) == ["10.0.0.1:50051", "10.0.0.2:50051"]
    time.sleep(0.6)
    assert servers_from_redis(redis_process.url) == ["10.0.0.2:50051"]


def test_redis_killed_and_restarted_keeps_its_state_and_clients_reconnect(redis_process):
    coordinator = RedisCoordinator(redis_process.url, timeout_s=0.5)
    coordinator.register_job("j", RECORD)
    coordinator.ack("j", 3, 0, 41)
    coordinator.acquire_lease("j", 3, "server-a", ttl_s=60)
    redis_process.kill()
    with pytest.raises(CoordinationUnavailable):
        coordinator.ack("j", 3, 0, 42)
    redis_process.start()  # same port and directory: the append-only file is replayed
    deadline = time.monotonic() + 10
    while True:  # the client's next calls reconnect by themselves
        try:
            assert coordinator.acked("j", 3) == (0, 41)
            break
        except CoordinationUnavailable:
            assert time.monotonic() < deadline, "the coordinator did not reconnect within 10 s"
            time.sleep(0.1)
    assert coordinator.job("j") == RECORD
    assert coordinator.lease_owner("j", 3) == "server-a"
    assert coordinator.ack("j", 3, 0, 40) == (0, 41)  # still monotone after the restart
    assert coordinator.ack("j", 3, 0, 42) == (0, 42)


def test_wrong_redis_password_is_a_clear_error(tmp_path):
    protected = RedisProcess(tmp_path / "protected", password="right").start()
    try:
        with pytest.raises(CoordinationError, match="refused the credentials"):
            RedisCoordinator(protected.url, password="wrong").job("j")
        assert RedisCoordinator(protected.url, password="right").job("j") is None
    finally:
        protected.stop()
