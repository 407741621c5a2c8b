"""The demo's serving part: serve the demo index and consume one epoch with one client per DP rank, measuring
the balance of what was delivered (a tool that uses the client, as any trainer would)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
from packfeed.client import LocalServer, PackStream
from packfeed.server.plan.metrics import dist_ratio
from tqdm import tqdm


def consume_epoch(index: Path, dp: int = 2, microbatches: int = 2, pipeline_stages: int = 2,
                  workers: int | None = None) -> dict:
    """Start a loader server on loopback, run one client per rank in its own thread, and measure what was
    delivered: per-rank ViT and LLM balance, throughput and the time clients spent waiting for data (these
    clients train nothing, so they wait on pre-processing nearly all the time)."""
    with LocalServer(index, workers=workers) as server:
        streams = [PackStream(server.target, job="demo", rank=r, dp=dp, microbatches=microbatches,
                              pipeline_stages=pipeline_stages, prefetch=2) for r in range(dp)]
        n_steps = len(streams[0])  # one epoch
        vit = np.zeros((n_steps, dp))
        llm = np.zeros((n_steps, dp))
        totals = {"samples": 0, "bytes": 0, "packs": 0}
        lock = threading.Lock()
        bar = tqdm(total=n_steps * dp, desc="steps x ranks", unit="step")

        errors: list[BaseException] = []

        def run(rank: int) -> None:
            try:
                receive(rank)
            except BaseException as error:  # re-raised below, in the caller's thread
                errors.append(error)

        def receive(rank: int) -> None:
            for step in streams[rank]:
                vit[step.step, rank] = sum(len(p.tile_shapes) for p in step.packs)
                llm[step.step, rank] = sum(len(p.input_ids) for p in step.packs)
                with lock:
                    totals["samples"] += len(step.sample_keys)
                    totals["bytes"] += step.nbytes
                    totals["packs"] += len(step.packs)
                    bar.update(1)

        started = time.perf_counter()
        threads = [threading.Thread(target=run, args=(r,)) for r in range(dp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - started
        bar.close()
        waits = [s.wait_seconds for s in streams]
        for s in streams:
            s.close()
        if errors:
            raise errors[0]
    return {"dp": dp, "microbatches": microbatches, "steps": n_steps, **totals,
            "vit_dist_delivered": round(dist_ratio(vit), 4), "llm_dist_delivered": round(dist_ratio(llm), 4),
            "seconds": round(wall, 2), "samples_per_second": round(totals["samples"] / wall, 1),
            "megabytes_per_second": round(totals["bytes"] / wall / 1e6, 1),
            "data_wait_fraction_per_rank": [round(w / wall, 3) for w in waits]}
