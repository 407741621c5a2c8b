"""What the docker-compose deployment relies on, with real `packfeed serve` processes on loopback: scaled
replicas sharing one port range, the address file and `packfeed health`, advertised addresses, and the
trainer's target forms (host:port lists, Redis discovery)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from packfeed.client import LocalServer
from packfeed.server.serve.config import port_candidates
from packfeed.trainer.data import stream_targets
from redis_server import RedisProcess
from test_docker import free_port_range

pytestmark = pytest.mark.slow


def health(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packfeed.cli", "health", *args], capture_output=True,
                          text=True, timeout=30, env=env)


def serving_event(server: LocalServer) -> dict:
    return next(json.loads(line) for line in server.log if '"serving"' in line)


def test_replicas_on_one_port_range_bind_different_ports_and_report_health(dataset, tmp_path):
    first = free_port_range(3)
    listen = ["--listen", f"127.0.0.1:{first}-{first + 2}"]
    files = [tmp_path / "a.address", tmp_path / "b.address"]
    with LocalServer(dataset, workers=1, extra_args=listen, env={"PACKFEED_ADDRESS_FILE": str(files[0]),
                                                                 "PACKFEED_ADVERTISE": "loader-host"}) as a, \
            LocalServer(dataset, workers=1, extra_args=listen, env={"PACKFEED_ADDRESS_FILE": str(files[1])}) as b:
        # the second replica found the first port taken (no SO_REUSEPORT sharing) and took the next
        assert (a.target, b.target) == (f"127.0.0.1:{first}", f"127.0.0.1:{first + 1}")
        assert files[1].read_text().strip() == b.target
        assert serving_event(a)["server_id"] == f"loader-host:{first}"  # a host alone gets the bound port
        assert serving_event(b)["server_id"] == b.target
        probe = health(env={"PACKFEED_ADDRESS_FILE": str(files[0]), "PATH": ""})
        assert probe.returncode == 0 and "SERVING" in probe.stdout
        third = LocalServer(dataset, workers=1, extra_args=["--listen", f"127.0.0.1:{first}-{first + 1}"])
        with pytest.raises(RuntimeError, match="every port is taken"):
            third.start()
        assert not any("Traceback" in line for line in third.log)  # a clear error, not a crash
    gone = health(a.target, "--timeout", "2")
    assert gone.returncode == 1 and "UNAVAILABLE" in gone.stderr


def test_port_specs_and_health_usage_errors():
    assert port_candidates("50051") == [50051]
    assert port_candidates("50051-50053") == [50051, 50052, 50053]
    assert port_candidates(0) == [0]
    for bad in ("50053-50051", "http", "70000"):
        with pytest.raises(ValueError):
            port_candidates(bad)
    usage = health(env={"PATH": ""})
    assert usage.returncode == 2 and "PACKFEED_ADDRESS_FILE" in usage.stderr


def test_trainer_targets_from_a_list_or_redis(tmp_path):
    assert stream_targets("h:1") == "h:1"
    assert stream_targets("h:1,h:2") == ["h:1", "h:2"]
    from packfeed.server.cluster.redis_coordinator import RedisCoordinator

    redis = RedisProcess(tmp_path / "redis").start()
    try:
        with pytest.raises(ValueError, match="no live Packfeed server"):
            stream_targets(redis.url)
        RedisCoordinator(redis.url).heartbeat_server("10.1.2.3:50051", 30)
        assert stream_targets(redis.url) == ["10.1.2.3:50051"]
    finally:
        redis.stop()
