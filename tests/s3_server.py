"""A real S3-protocol server for tests: moto's standalone server in its own process on 127.0.0.1, and a
fault-injecting HTTP proxy in front of it (its own process too) that answers some requests with 503 SlowDown
or 429 and drops some connections mid-answer, as a throttling or flaky store does."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from ports import free_port

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "packfeed-test", "AWS_SECRET_ACCESS_KEY": "packfeed-test",
               "AWS_DEFAULT_REGION": "us-east-1"}


def wait_for_port(port: int, process: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server process exited with {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


def start_process(command: list[str], port: int) -> subprocess.Popen:
    """A server process, quiet, once something listens on its port."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port(port, process)
    return process


def stop_process(process: subprocess.Popen | None) -> None:
    if process and process.poll() is None:
        process.terminate()
        process.wait(10)


class S3Server:
    """moto_server on a free port; `env` points boto3/s3fs at it."""

    def __init__(self):
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def start(self) -> S3Server:
        self.process = start_process([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     self.port)
        return self

    def stop(self) -> None:
        stop_process(self.process)


class FaultyProxy:
    """tests/s3_faults.py in its own process: every `every`-th request (none with 0) is answered 503 SlowDown,
    429, or its connection is dropped mid-answer, in turn; the rest go to `upstream` after `delay_ms`.
    `count()` says how many were hit."""

    def __init__(self, upstream: str, directory: Path, every: int = 4, delay_ms: float = 0, only_ranges: bool = False):
        self.port, self.upstream, self.every, self.delay_ms = free_port(), upstream, every, delay_ms
        self.only_ranges = only_ranges  # delay range GETs only
        self.counter = Path(directory) / "faults.txt"
        self.process: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}"}

    def start(self) -> FaultyProxy:
        script = Path(__file__).with_name("s3_faults.py")
        self.process = start_process([sys.executable, str(script), str(self.port), self.upstream, str(self.every),
                                      str(self.counter), str(self.delay_ms)] + (["ranges"] if self.only_ranges else []),
                                     self.port)
        return self

    def count(self) -> dict[str, int]:
        """Faults injected so far, by kind."""
        kinds: dict[str, int] = {}
        for line in self.counter.read_text().split() if self.counter.exists() else []:
            kinds[line] = kinds.get(line, 0) + 1
        return kinds

    def stop(self) -> None:
        stop_process(self.process)


def set_env(env: dict[str, str]) -> dict[str, str | None]:
    """Set variables in this process; returns what to restore."""
    previous = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    return previous


@contextlib.contextmanager
def running(server):
    """`server` started and this process's environment pointing at it; both undone afterwards."""
    server.start()
    previous = set_env(server.env)
    try:
        yield server
    finally:
        restore_env(previous)
        server.stop()


def restore_env(previous: dict[str, str | None]) -> None:
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
