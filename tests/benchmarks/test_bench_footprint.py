"""Memory of a `packfeed serve` process tree (the server, the workers' fork server, the workers, multiprocessing's
resource tracker), as an operator sizes a machine for it:
- before its first job: the server process's resident memory, and the whole tree's;
- under load (two ranks streaming an epoch through 2 workers), sampled every 0.2 s: the tree's memory with
  each physical page counted once however many of its processes map it (the workers are forks of one process
  and share what it loaded; read from /proc/PID/pagemap, so other processes on the machine do not change it),
  against `--memory-budget-mb` and the bound docs/serving.md "Memory" gives an operator;
- each worker idle after serving (once it has given back what it keeps while busy).
In the same run, a process that only imports `webdataset` (what every server process paid when the shard reader
imported it, and with it torch).

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_footprint.py -m benchmark
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from packfeed.client import LocalServer, PackStream
from packfeed.server.serve.worker_process import GIVE_BACK_AFTER_S, KEEP_FREED_BYTES
from processes import descendants, tree_resident_mib, wait_for_start, workers

pytestmark = pytest.mark.benchmark
MIB = 1 << 20
BUDGET_MB = 512
WORKER_IDLE_MIB = 150  # docs/serving.md "Memory": a worker's own, idle


def status_mib(pid: int, field: str = "VmRSS") -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(f"{field}:"))) / 1024


def tree(pid: int) -> list[int]:
    return [pid, *descendants(pid)]


def tree_rss_mib(pid: int) -> float:
    """What `ps` adds up: each process's resident memory, pages shared between them counted in each."""
    return sum(status_mib(each) for each in tree(pid) if Path(f"/proc/{each}").exists())


@pytest.fixture(scope="module")
def photo_index(tmp_path_factory) -> Path:
    """The demo's photographs at the default policy (InternVL, 448 px tiles, up to 12 per image)."""
    from demo_data import indexed_demo

    return indexed_demo(tmp_path_factory.mktemp("photos"), 240, 4, 2)[1]


def stream_epoch(target: str, rank: int) -> None:
    with PackStream(target, job="load", rank=rank, dp=2, microbatches=2, epochs=1) as stream:
        for _ in stream:
            pass


@pytest.mark.parametrize("tiles", ["112 px", "448 px"])
def test_server_tree_memory_before_its_first_job_under_load_and_idle(small_tile_index, photo_index, tmp_path, tiles):
    index = small_tile_index if tiles == "112 px" else photo_index
    probe = "import os, webdataset; print(open(f'/proc/{os.getpid()}/status').read())"
    status = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout
    webdataset_rss = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024
    config = tmp_path / "server.yaml"
    config.write_text(yaml.safe_dump({"memory_budget_mb": BUDGET_MB, "datasets": {"demo": {"index": str(index)}}}))
    with LocalServer(config=config, workers=2) as server:
        pid = server.process.pid
        wait_for_start(server)
        time.sleep(1.0)
        first = status_mib(pid), tree_rss_mib(pid), tree_resident_mib(pid), len(tree(pid))
        samples: list[tuple[float, float]] = []
        ranks = [threading.Thread(target=stream_epoch, args=(server.target, rank)) for rank in range(2)]
        for rank in ranks:
            rank.start()
        while any(rank.is_alive() for rank in ranks):
            samples.append((tree_resident_mib(pid), tree_rss_mib(pid)))
            busy_workers = [status_mib(w) for w in workers(pid)]
            time.sleep(0.2)
        for rank in ranks:
            rank.join()
        time.sleep(GIVE_BACK_AFTER_S + 1.5)  # idle: the workers have given back the memory they kept for steps
        idle = status_mib(pid), [status_mib(w) for w in workers(pid)], tree_resident_mib(pid)
    peak_tree, peak_rss = max(once for once, _ in samples), max(rss for _, rss in samples)
    # docs/serving.md "Memory": the server with its fork server (400 MiB, each page once, plus the step files it
    # keeps: a quarter of the budget), per worker 150 MiB of its own and what it keeps while busy, and the budget
    bound = 400 + BUDGET_MB / 4 + 2 * (WORKER_IDLE_MIB + KEEP_FREED_BYTES / MIB) + BUDGET_MB
    print(f"\n[footprint {tiles} tiles] a process importing webdataset (and so torch): {webdataset_rss:.0f} MiB")
    print(f"[footprint {tiles} tiles] before its first job: server process {first[0]:.0f} MiB resident; the tree "
          f"({first[3]} processes) {first[2]:.0f} MiB, each page once ({first[1]:.0f} MiB summing each process's "
          "resident memory, which counts the pages they share once per process)")
    print(f"[footprint {tiles} tiles] under load (2 ranks, 2 workers, {len(samples)} samples): the tree's peak "
          f"{peak_tree:.0f} MiB, each page once ({peak_rss:.0f} MiB by resident sums) with --memory-budget-mb "
          f"{BUDGET_MB}; the documented bound {bound:.0f} MiB; workers' resident memory near the end: "
          f"{', '.join(f'{w:.0f}' for w in busy_workers)} MiB")
    print(f"[footprint {tiles} tiles] idle after serving: server {idle[0]:.0f} MiB, workers "
          f"{', '.join(f'{w:.0f}' for w in idle[1])} MiB resident; the tree {idle[2]:.0f} MiB, each page once")
    assert first[0] <= 300 and first[2] <= 400 and peak_tree <= bound and max(idle[1]) <= WORKER_IDLE_MIB
