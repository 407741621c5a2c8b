"""What a job's length costs (issue [1/6]): a job counts every epoch's steps at its open (and the rest in the
background), each counted by `count_steps` (its packs formed and counted) instead of planned whole
(`make_plan`). Both in-process, alternating, on the same loads and caps, 5 epochs each:
- an InternVL-1.2M-like mix of 1.2M samples (`internvl_mix.py`), DP 8, M 4, isf+balance, collective-safe;
- a mostly-text mix (`test_bench_collective.mostly_text_mix`: 80% text, 15% the files' image samples, 5% videos),
  DP 8, M 4, where collective-safe plans merge and split packs;
- the long-video mix (`tests/long_video_mix.py`), DP 8, CP 4 dynamic, M 4, N 40,960, collective-safe: the count
  sizes and splits packs into slots but places none.
Prints per epoch: the median and the range of each, and the ratio of the medians; asserts the counts equal the
plans' steps.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_step_count.py -m benchmark
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import real_lengths_available
from internvl_mix import internvl_like_mix

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from long_video_mix import write_long_video_mix  # noqa: E402

pytestmark = pytest.mark.benchmark
EPOCHS = 5


def internvl_1_2m():
    from packfeed.server.plan.costs import SampleLoads
    from packfeed.v1.options import PlanConfig

    vision, tokens = internvl_like_mix(1_200_000)
    return SampleLoads.from_arrays(vision, tokens), PlanConfig(dp=8, microbatches=4)


def mostly_text():
    from test_bench_collective import mostly_text_mix

    from packfeed.server.plan.costs import SampleLoads
    from packfeed.v1.options import PlanConfig

    vision, tokens, towers = mostly_text_mix()
    loads = SampleLoads.from_arrays(vision, tokens)
    loads.towers = towers
    return loads, PlanConfig(dp=8, microbatches=4)


def long_video(tmp_path):
    from packfeed.server.plan.costs import SampleLoads
    from packfeed.v1.options import PlanConfig

    records = json.loads(write_long_video_mix(tmp_path / "mix.json").read_text())
    loads = SampleLoads.from_arrays([r["vit_num"] for r in records], [r["token_num"] for r in records])
    return loads, PlanConfig(dp=8, microbatches=4, context_parallel=4, max_tokens_per_gpu=40960)


@pytest.mark.skipif(not real_lengths_available(), reason="needs ../shared/data/lengths")
@pytest.mark.parametrize("mix", ["internvl-1.2M", "mostly-text", "long-video-cp4"])
def test_counting_an_epoch_against_planning_it(mix, tmp_path):
    from packfeed.server.plan.caps import resolve_caps
    from packfeed.server.plan.planner import count_steps, make_plan

    loads, config = {"internvl-1.2M": internvl_1_2m, "mostly-text": mostly_text,
                     "long-video-cp4": lambda: long_video(tmp_path)}[mix]()
    caps = resolve_caps(loads, config)
    count_steps(loads, config, 0, 0, caps), make_plan(loads, config, 0, 0, caps=caps)  # compiled, warm
    planned, counted, plan_s, count_s = [], [], [], []
    for epoch in range(1, EPOCHS + 1):
        started = time.perf_counter()
        planned.append(make_plan(loads, config, 0, epoch, caps=caps).n_steps)
        plan_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        counted.append(count_steps(loads, config, 0, epoch, caps))
        count_s.append(time.perf_counter() - started)
    print(f"\n[step count] {mix}: {len(loads):,} samples, steps per epoch {planned}; planned whole "
          f"{statistics.median(plan_s):.3f} s (range {min(plan_s):.3f}-{max(plan_s):.3f}), counted "
          f"{statistics.median(count_s):.3f} s (range {min(count_s):.3f}-{max(count_s):.3f}); "
          f"{statistics.median(plan_s) / statistics.median(count_s):.1f}x")
    assert counted == planned
    assert np.all(np.asarray(planned) > 0)
