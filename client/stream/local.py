"""Embedded mode: a Packfeed server on loopback, started and stopped by the trainer process.

It is the same `packfeed serve` that runs remotely, in a child process, so the same code path serves
packs. It listens on a free port the OS picks and reports it when ready.

    with LocalServer("data/index.parquet", workers=4) as server:
        streams = [PackStream(server.target, job="j", rank=r, dp=2) for r in range(2)]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path


class LocalServer:
    def __init__(self, index: str | Path | None = None, *, config: str | Path | None = None, workers: int | None = None,
                 prefetch_steps: int | None = None, metrics_port: int | None = None, startup_timeout: float = 120.0,
                 extra_args: list[str] | None = None, env: dict[str, str] | None = None):
        self.args = [sys.executable, "-m", "packfeed.cli", "serve", "--listen", "127.0.0.1:0"]
        for flag, value in (("--index", index), ("--config", config), ("--workers", workers),
                            ("--prefetch-steps", prefetch_steps), ("--metrics-port", metrics_port)):
            if value is not None:
                self.args += [flag, str(value)]
        self.args += extra_args or []
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None
        self.target = ""
        self.log: list[str] = []  # the server's structured log lines

    def start(self) -> LocalServer:
        # the server stops once this process is gone, however it ends (a kill -9 of the rank included)
        self.process = subprocess.Popen(self.args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                        env={**self.env, "PACKFEED_EXIT_WITH_PARENT": str(os.getpid())})
        ready = threading.Event()
        reader = threading.Thread(target=self._read_log, args=(ready,), daemon=True)
        reader.start()
        deadline = time.monotonic() + self.startup_timeout
        while not ready.wait(0.1):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                reader.join(5.0)  # the exited server's last lines (its error) read to the end before they are shown
                raise RuntimeError("the embedded Packfeed server did not start:\n" + "\n".join(self.log[-20:]))
        return self

    def _read_log(self, ready: threading.Event) -> None:
        for line in self.process.stderr:
            self.log.append(line.rstrip())
            if not ready.is_set():
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("event") == "serving":
                    self.target = f"127.0.0.1:{event['port']}"
                    ready.set()

    def stop(self, timeout: float = 15.0) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
