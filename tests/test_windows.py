"""Windowed planning: exactly once per epoch, the same plan however it is walked (and on every server), each
window from its own part of the epoch's permutation."""

from __future__ import annotations

import numpy as np
import torch
import pytest

from packfeed.server.plan.costs import SampleLoads
from packfeed.server.plan.windows import WindowedPlan, affine_order, window_members
from packfeed.v1.options import PlanConfig, Strategy


def synthetic_loads(n: int, seed: int = 0) -> SampleLoads:
    rng = np.random.default_rng(seed)
    valid = rng.random(n) > 0.03
    return SampleLoads.from_arrays(rng.integers(0, 13, n), rng.integers(64, 4096, n), valid)


def walk(plan: WindowedPlan) -> list[list[np.ndarray]]:
    """Every step's packs, in order, until the epoch ends."""
    steps, step = [], 0
    while True:
        try:
            steps.append([plan.pack_with_truncation(step, r, m)[0].copy() for r in range(plan.config.dp)
                          for m in range(plan.config.microbatches)])
        except IndexError:
            return steps
        step += 1


@pytest.mark.parametrize("strategy", [Strategy.ISF_BALANCE, Strategy.RANDOM])
def test_every_valid_sample_exactly_once(strategy):
    loads = synthetic_loads(10_000)
    plan = WindowedPlan(loads, PlanConfig(dp=2, microbatches=2, strategy=strategy), seed=3, epoch=1, size=1_500)
    steps = walk(plan)
    members = np.concatenate([pack for step in steps for pack in step])
    assert np.array_equal(np.sort(members), np.flatnonzero(loads.valid))
    assert plan.n_windows == 7 and len(steps) == plan.n_steps
    assert plan.is_last_step(len(steps) - 1) and not plan.is_last_step(len(steps) - 2)


def test_the_same_plan_however_it_is_walked():
    loads = synthetic_loads(8_000, seed=1)
    config = PlanConfig(dp=4, microbatches=2, pipeline_stages=2)
    in_order = walk(WindowedPlan(loads, config, seed=5, epoch=0, size=1_000))
    other = WindowedPlan(loads, config, seed=5, epoch=0, size=1_000, keep=2)  # another server, jumping about
    last = len(in_order) - 1
    for step in (last, 0, last // 2, 1, last):
        assert all(np.array_equal(a, other.pack_with_truncation(step, r, m)[0])
                   for (r, m), a in zip(((r, m) for r in range(4) for m in range(2)), in_order[step]))
    another_epoch = walk(WindowedPlan(loads, config, seed=5, epoch=1, size=1_000))
    assert not all(np.array_equal(a, b) for a, b in zip(in_order[0], another_epoch[0]))


def test_windows_partition_the_epoch():
    valid = synthetic_loads(9_973).valid  # a prime: every a in [1, n) is coprime
    windows = [window_members(valid, 7, 2, w, 1_000) for w in range(10)]
    together = np.concatenate(windows)
    assert len(together) == len(np.unique(together)) == valid.sum()
    a, b = affine_order(len(valid), 7, 2)
    assert (a, b) != affine_order(len(valid), 7, 3)  # each epoch its own order
    spread = [np.ptp(w) for w in windows[:-1]]
    assert min(spread) > 0.9 * len(valid)  # a window spans the whole dataset, not a slice of it


def test_a_windowed_job_is_served_exactly_once_and_alike_by_two_servers(small_tile_index):
    """Over real gRPC: every sample once per epoch across the ranks, and two servers planning on their own
    stream the same packs (a windowed plan is a pure function of the job)."""
    import grpc

    from packfeed.client import LocalServer, PackStream
    from packfeed.server.index.table import read_index
    from packfeed.v1 import packfeed_pb2 as pb
    from packfeed.v1 import packfeed_pb2_grpc as pb_grpc

    valid = read_index(small_tile_index, ["key", "valid"])[0].to_pylist()
    served = []
    for _ in range(2):
        with LocalServer(small_tile_index, workers=1) as server:
            steps = {}
            for rank in range(2):
                with PackStream(server.target, job="windowed", rank=rank, dp=2, microbatches=2, window=12) as stream:
                    steps[rank] = [(step.step, [(p.sample_keys, p.input_ids.clone()) for p in step.packs])
                                   for step in stream]
            info = pb_grpc.PackfeedStub(grpc.insecure_channel(server.target)).GetJob(pb.GetJobRequest(job="windowed"))
        served.append((steps, info))
    (steps, info), (again, info_again) = served
    keys = [key for rank in steps.values() for _, packs in rank for pack_keys, _ in packs for key in pack_keys]
    assert sorted(keys) == sorted(r["key"] for r in valid if r["valid"])
    assert info.plan.window == 12 and info.steps_per_epoch == len(steps[0]) > 0
    assert info.plan_fingerprint == info_again.plan_fingerprint
    for rank in steps:
        assert [s for s, _ in steps[rank]] == [s for s, _ in again[rank]]
        for (_, packs), (_, other) in zip(steps[rank], again[rank]):
            assert all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(packs, other))


def test_carried_samples_do_not_keep_their_windows_alive():
    """What a window carries into the next is a copy: a view would hold the window's whole members array for
    the rest of the epoch, and memory would grow window by window (as it did, 1.5 GiB over 100M samples)."""
    plan = WindowedPlan(synthetic_loads(6_000, seed=2), PlanConfig(dp=2, microbatches=2), seed=0, epoch=0, size=1_000)
    walk(plan)
    carried = [ids for ids in plan._carried.values() if len(ids)]
    assert len(carried) >= 3 and all(ids.base is None for ids in carried)


def test_packfeed_plan_window_summarises_the_epoch_from_the_mapped_columns(small_tile_index, tmp_path):
    import json
    import shutil
    import subprocess
    import sys

    from packfeed.server.index.table import read_index

    index = tmp_path / "index.parquet"
    shutil.copy(small_tile_index, index)
    done = subprocess.run([sys.executable, "-m", "packfeed.cli", "plan", "--index", str(index), "--dp", "2",
                           "--window", "12"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    valid = sum(read_index(index, ["valid"])[0].column("valid").to_pylist())
    assert summary["samples"] == valid and summary["windows"] >= 3 and summary["steps"] > 0
    assert 0 <= summary["vit_dist"] < 1 and list(tmp_path.glob("index.*.plan.arrow"))  # mapped beside the index
