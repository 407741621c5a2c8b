"""Windowed against whole-epoch planning on the InternVL-1.2M-like mix: time to the first step, peak RSS (each
in a fresh process, the synthetic loads included), and the balance (ViT / LLM Dist over every step of the
epoch), DP 8, isf+balance, windows of 4M samples. 10M samples; 100M with PACKFEED_BENCH_100M=1.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_windows.py -m benchmark
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.benchmark
SIZES = [10_000_000] + ([100_000_000] if os.environ.get("PACKFEED_BENCH_100M") else [])

SCRIPT = """
import json, resource, sys, time
sys.path.insert(0, {benchmarks!r})
from internvl_mix import internvl_like_mix
from packfeed.server.plan.costs import SampleLoads
from packfeed.server.plan.metrics import dist_ratio
from packfeed.server.plan.planner import make_plan
from packfeed.server.plan.windows import WindowedPlan
from packfeed.v1.options import PlanConfig

vision, tokens = internvl_like_mix({n})
loads = SampleLoads.from_arrays(vision, tokens)
del vision, tokens
config = PlanConfig(dp=8, microbatches=1)
loaded_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
started = time.perf_counter()
if {windowed!r}:
    plan = WindowedPlan(loads, config, 0, 0, size=4_000_000)
    plan.pack_with_truncation(0, 0, 0)
    first, rss = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    vit, llm, _ = plan.epoch_loads()
else:
    whole = make_plan(loads, config, 0, 0)
    first, rss = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    vit, llm = (side.reshape(whole.n_steps, 8) for side in whole.pack_loads(loads))
print(json.dumps(dict(first=first, rss=rss, loaded_rss=loaded_rss, steps=len(vit), vit=dist_ratio(vit),
                      llm=dist_ratio(llm), total=time.perf_counter() - started)))
"""


@pytest.mark.parametrize("n", SIZES)
def test_windowed_against_whole_epoch_planning(n):
    benchmarks = str(Path(__file__).parent)
    results = {}
    for windowed in (False, True):
        done = subprocess.run([sys.executable, "-c", SCRIPT.format(benchmarks=benchmarks, n=n, windowed=windowed)],
                              capture_output=True, text=True, timeout=3000)
        assert done.returncode == 0, done.stderr[-3000:]
        results[windowed] = json.loads(done.stdout.strip().splitlines()[-1])
        r = results[windowed]
        print(f"\n[windows] n={n:,} {'windowed (4M)' if windowed else 'whole epoch'}: first step after "
              f"{r['first']:.1f} s, peak RSS {r['rss']:.2f} GiB (loads alone {r['loaded_rss']:.2f}), steps "
              f"{r['steps']:,}, ViT Dist {r['vit']:.2e}, LLM Dist {r['llm']:.2e}, whole epoch planned in "
              f"{r['total']:.1f} s", end="")
    assert results[True]["first"] > 0 and results[False]["steps"] > 0
