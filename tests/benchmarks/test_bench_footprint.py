"""Memory per server process: resident memory of `packfeed serve` before its first job, and of it and each
pre-processing worker idle after serving (once the workers have given back what they keep while busy); in the
same run, a process that only imports `webdataset` (what every server process paid when the shard reader
imported it, and with it torch).

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_footprint.py -m benchmark
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from packfeed.client import LocalServer, PackStream
from packfeed.server.serve.worker_process import GIVE_BACK_AFTER_S

pytestmark = pytest.mark.benchmark


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.fixture(scope="module")
def photo_index(tmp_path_factory) -> Path:
    """The demo's photographs at the default policy (InternVL, 448 px tiles, up to 12 per image)."""
    from demo_data import indexed_demo

    return indexed_demo(tmp_path_factory.mktemp("photos"), 60, 2, 1)[1]


@pytest.mark.parametrize("tiles", ["112 px", "448 px"])
def test_server_and_worker_memory(small_tile_index, photo_index, tiles):
    index = small_tile_index if tiles == "112 px" else photo_index
    probe = "import os, webdataset; print(open(f'/proc/{os.getpid()}/status').read())"
    status = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout
    webdataset_rss = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024
    with LocalServer(index, workers=2) as server:
        time.sleep(2)
        idle_server = rss_mib(server.process.pid)
        with PackStream(server.target, job="footprint", rank=0, dp=1, microbatches=2, epochs=1) as stream:
            steps = 0
            for _ in stream:
                steps += 1
                if steps == 5:
                    break
            busy = [rss_mib(w) for w in children(server.process.pid)]  # right after 5 steps, still streaming
        time.sleep(GIVE_BACK_AFTER_S + 1.5)  # idle: the workers have given back the memory they kept for steps
        idle_after = rss_mib(server.process.pid), [rss_mib(w) for w in children(server.process.pid)]
    print(f"\n[footprint {tiles} tiles] a process importing webdataset (and so torch): {webdataset_rss:.0f} MiB")
    print(f"[footprint {tiles} tiles] server before its first job: {idle_server:.0f} MiB (workers start with the "
          "first job)")
    print(f"[footprint {tiles} tiles] child processes (workers, multiprocessing's resource tracker) right after "
          f"{steps} steps, still streaming: {', '.join(f'{w:.0f}' for w in busy)} MiB")
    print(f"[footprint {tiles} tiles] idle after serving: server {idle_after[0]:.0f} MiB, child processes "
          f"{', '.join(f'{w:.0f}' for w in idle_after[1])} MiB")
    assert idle_server <= 400 and max(idle_after[1]) <= 250
