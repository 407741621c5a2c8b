"""Compiling the planner's and the exact resizer's kernels ahead of the first job.

The planner's kernels and the exact path's bicubic resize are numba functions compiled on first use (about 15
CPU seconds) and cached on disk (`cache=True`: beside the package, or under NUMBA_CACHE_DIR). A fresh container
would pay that before its first pack. `warm_up()` plans a small synthetic epoch through every code path and
resizes a small image every way the resizer can (packfeed.media.resample.compile_kernels), so every
kernel is compiled, and cached, once: `packfeed warmup` runs it where an image is built or a virtual environment
installed, and `packfeed serve` runs it (the planner's part: its workers' fork server loads the media kernels) in
a child process at start (`warm_up_in_background`), so a cold cache costs no job more than what is left.

In a child, not in the server: a server loads numba (about 160 MiB with its kernels, packfeed.media.jit) when it
first plans, not before, so a server that holds no job yet (a standby, a fleet before training) does without
it; with the cache warm, its first plan loads numba and the kernels in about 0.4 s (BENCHMARKS.md "Memory per
server process").

The cache is valid for the CPU it was compiled for. An image built on one machine and run on others keeps
it valid with NUMBA_CPU_NAME (e.g. x86-64-v3) and an empty NUMBA_CPU_FEATURES at build and run time
(docker/server.Dockerfile does).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from packfeed.media.resample import compile_kernels
from packfeed.server.plan.costs import SampleLoads
from packfeed.server.plan.planner import make_plan
from packfeed.v1.options import Oversize, PlanConfig, Strategy

# Configurations that reach every kernel: each strategy (the default first: a job arriving during a server's
# warm-up most likely needs it), pipeline reordering, each oversize policy, context parallelism, and the
# encoder on ranks of its own.
_CONFIGS = [PlanConfig(dp=2, microbatches=2, pipeline_stages=2, strategy=strategy)
            for strategy in (Strategy.ISF_BALANCE, Strategy.ISF, Strategy.RANDOM, Strategy.LENGTH_GROUP)] + \
           [PlanConfig(dp=2, microbatches=2, strategy=Strategy.ISF_BALANCE, vision_cap=8, token_cap=2048, oversize=oversize)
            for oversize in (Oversize.SKIP, Oversize.TRUNCATE)] + \
           [PlanConfig(dp=2, microbatches=2, context_parallel=4, max_tokens_per_gpu=1024, cp_mode=mode)
            for mode in ("dynamic", "static")] + \
           [PlanConfig(dp=2, microbatches=2, encoder_ranks=3)]


def warm_up(media: bool = True, plan_files: bool = True) -> float:
    """Plan a small synthetic dataset with every configuration above, (with `plan_files`) write each plan, and
    (with `media`) compile the media kernels; returns the seconds it took. A server needs neither: it leaves the
    media kernels to its workers' fork server, which loads them anyway (the main process decodes nothing), and it
    never writes a plan file (the file's kernel and Arrow's table took 31 MiB more resident in a process that had
    planned, measured on 2026-12-02; a started server showed no difference within its noise)."""
    started = time.perf_counter()
    if media:
        compile_kernels()
    rng = np.random.default_rng(0)
    loads = SampleLoads.from_arrays(rng.integers(0, 13, 512), rng.integers(64, 4096, 512))
    # An index's columns arrive read-only (views of Arrow memory), which numba compiles for apart
    read_only = SampleLoads(loads.valid, loads.vision.copy(), loads.tokens.copy(), loads.vit_patches, loads.vit_attn_sq)
    for column in (read_only.vision, read_only.tokens):
        column.setflags(write=False)
    with tempfile.TemporaryDirectory(prefix="packfeed-warmup-") as directory:
        for config in _CONFIGS:
            for each in (loads, read_only):
                plan = make_plan(each, config, seed=0, epoch=0)
                if plan_files:
                    plan.write(Path(directory) / "plan.parquet")
    return time.perf_counter() - started


def warm_up_in_background(done: Callable[[float], None] | None = None,
                          failed: Callable[[str], None] | None = None) -> threading.Thread:
    """The planner's part of `warm_up()` in a child process, waited for by a daemon thread: `done(seconds)` once
    it exited 0, else `failed(what it said)`. The kernels it compiles land in numba's cache, which the server's
    own first plan then loads."""
    def run() -> None:
        started = time.perf_counter()
        child = subprocess.run([sys.executable, "-c", _IN_A_CHILD], capture_output=True, text=True)
        if child.returncode == 0:
            if done is not None:
                done(time.perf_counter() - started)
        elif failed is not None:
            failed((child.stderr or child.stdout)[-2000:])

    thread = threading.Thread(target=run, name="packfeed-warmup", daemon=True)
    thread.start()
    return thread


_IN_A_CHILD = "from packfeed.server.plan.warmup import warm_up; warm_up(media=False, plan_files=False)"
