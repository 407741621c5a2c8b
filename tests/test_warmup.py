"""`packfeed warmup` compiles and caches every planner kernel, so a fresh process plans without compiling, and
`packfeed serve` warms them in the background at start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from packfeed.client import LocalServer, PackStream


def packfeed(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packfeed.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=600)


def test_a_warmed_cache_lets_fresh_processes_and_servers_start_without_compiling(
        tmp_path, small_tile_index):
    """`packfeed warmup` on a cold cache, then fresh processes that plan every way without compiling (the control:
    with one kernel's cache removed, a plan compiles it), and a server that warms up at start (the same
    `warm_up`) without blocking a job. One cold warm-up: each costs the suite half a minute."""
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "numba-cache")}
    assert packfeed("warmup", env=env).returncode == 0
    assert any(path.suffix == ".nbc" for path in (tmp_path / "numba-cache").rglob("*"))
    # the control: the same cache less one kernel, which a plan then compiles (and says so)
    shutil.copytree(tmp_path / "numba-cache", tmp_path / "less-one")
    removed = [path.unlink() or path for path in (tmp_path / "less-one").rglob("*first_fit_decreasing*")]
    assert removed
    done = packfeed("plan", "--index", str(small_tile_index), "--dp", "2", "--out", str(tmp_path / "plan.parquet"),
                    env={"NUMBA_CACHE_DIR": str(tmp_path / "less-one"), "NUMBA_DEBUG_CACHE": "1"})
    assert "[cache] data saved" in done.stdout + done.stderr
    for extra in (["--pipeline-stages", "2"], ["--strategy", "length-group"], ["--oversize", "truncate"]):
        done = packfeed("plan", "--index", str(small_tile_index), "--dp", "2", "--microbatches", "2", *extra,
                        "--out", str(tmp_path / "plan.parquet"), env={**env, "NUMBA_DEBUG_CACHE": "1"})
        assert done.returncode in (0, 3), done.stderr[-2000:]
        log = done.stdout + done.stderr
        assert "[cache] data loaded" in log and "[cache] data saved" not in log, (extra, log[-3000:])
    with LocalServer(small_tile_index, workers=1, env=env) as server:
        with PackStream(server.target, job="warm", rank=0, dp=1, microbatches=1) as stream:
            assert next(iter(stream)).sample_keys  # a job while the warm-up runs waits for no more than it
        deadline = time.monotonic() + 300
        while not any('"planner ready"' in line for line in server.log) and time.monotonic() < deadline:
            time.sleep(0.5)
    assert any('"planner ready"' in line for line in server.log), server.log[-5:]
