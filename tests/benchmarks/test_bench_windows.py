"""Windowed against whole-epoch planning on the InternVL-1.2M-like mix: time to the first step, peak RSS (each
in a fresh process reading the planner's columns from their file: in memory for whole-epoch planning, mapped
for windows), and the balance (ViT / LLM Dist over every step of the
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

PREPARE = """
import sys
sys.path.insert(0, {benchmarks!r})
from pathlib import Path
from internvl_mix import internvl_like_mix
from packfeed.server.plan.costs import SampleLoads
from packfeed.server.plan.mapped_loads import BATCH_ROWS, write_plan_columns

loads = SampleLoads.from_arrays(*internvl_like_mix({n}))
names = ("valid", "vision", "tokens", "vit_patches", "vit_attn_sq")
write_plan_columns(({{name: getattr(loads, name)[start:start + BATCH_ROWS] for name in names}}
                    for start in range(0, len(loads), BATCH_ROWS)), Path({path!r}))
"""

SCRIPT = """
import json, resource, sys, time
from pathlib import Path
import numpy as np
import pyarrow as pa
from packfeed.server.plan.costs import SampleLoads
from packfeed.server.plan.mapped_loads import MappedLoads
from packfeed.server.plan.metrics import dist_ratio
from packfeed.server.plan.planner import make_plan
from packfeed.server.plan.windows import WindowedPlan
from packfeed.v1.options import PlanConfig

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

if {windowed!r}:  # as `packfeed plan --window` and windowed jobs: the columns mapped
    loads = MappedLoads(Path({path!r}))
else:  # as whole-epoch planning: the columns in memory
    table = pa.ipc.open_file(pa.memory_map({path!r})).read_all()
    columns = {{name: table.column(name).to_numpy() for name in table.column_names}}
    loads = SampleLoads(**{{**columns, "valid": columns["valid"].astype(bool)}})
    del table
config = PlanConfig(dp=8, microbatches=1)
loaded_rss = peak()
started = time.perf_counter()
if {windowed!r}:
    plan = WindowedPlan(loads, config, 0, 0, size=4_000_000)
    plan.pack_with_truncation(0, 0, 0)
    first, rss = time.perf_counter() - started, peak()
    balance = plan.epoch_balance()
    steps, vit, llm = balance["steps"], balance["vit_dist"], balance["llm_dist"]
else:
    whole = make_plan(loads, config, 0, 0)
    first, rss = time.perf_counter() - started, peak()
    steps = whole.n_steps
    vit, llm = (dist_ratio(side.reshape(whole.n_steps, 8)) for side in whole.pack_loads(loads))
print(json.dumps(dict(first=first, rss=rss, loaded_rss=loaded_rss, steps=steps, vit=vit, llm=llm,
                      total=time.perf_counter() - started, final_rss=peak())))
"""


@pytest.mark.parametrize("n", SIZES)
def test_windowed_against_whole_epoch_planning(n, tmp_path):
    benchmarks = str(Path(__file__).parent)
    path = str(tmp_path / "loads.plan.arrow")
    done = subprocess.run([sys.executable, "-c", PREPARE.format(benchmarks=benchmarks, n=n, path=path)],
                          capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-3000:]
    results = {}
    for windowed in (False, True):
        done = subprocess.run([sys.executable, "-c", SCRIPT.format(path=path, windowed=windowed)],
                              capture_output=True, text=True, timeout=3000)
        assert done.returncode == 0, done.stderr[-3000:]
        results[windowed] = json.loads(done.stdout.strip().splitlines()[-1])
        r = results[windowed]
        print(f"\n[windows] n={n:,} {'windowed (4M), columns mapped' if windowed else 'whole epoch'}: first step "
              f"after {r['first']:.1f} s, peak RSS at the first step {r['rss']:.2f} GiB (columns loaded "
              f"{r['loaded_rss']:.2f}), over the whole epoch {r['final_rss']:.2f}, steps {r['steps']:,}, ViT Dist "
              f"{r['vit']:.2e}, LLM Dist {r['llm']:.2e}, whole epoch planned in {r['total']:.1f} s", end="")
    assert results[True]["first"] > 0 and results[False]["steps"] > 0


def test_how_many_least_balanced_steps_to_carry():
    """The choice of `CARRIED_FRACTION`: windowed Dist (10M samples, windows of 4M, DP 8) against whole-epoch
    planning's for several fractions of each window's steps carried into the next, seeds 0-2."""
    import numpy as np

    from internvl_mix import internvl_like_mix
    from packfeed.server.plan import windows
    from packfeed.server.plan.costs import SampleLoads
    from packfeed.server.plan.metrics import dist_ratio
    from packfeed.server.plan.planner import make_plan
    from packfeed.v1.options import PlanConfig

    loads = SampleLoads.from_arrays(*internvl_like_mix(10_000_000))
    config = PlanConfig(dp=8)
    kept = windows.CARRIED_FRACTION
    results: dict[str, list] = {}
    try:
        for seed in range(3):
            whole = make_plan(loads, config, seed, 0)
            results.setdefault("whole epoch", []).append(
                [dist_ratio(side.reshape(-1, 8, config.microbatches).sum(axis=2)) for side in whole.pack_loads(loads)])
            del whole
            for label, fraction in (("windows, nothing carried", 0.0), ("windows, a 32nd carried", 1 / 32),
                                    ("windows, a 28th carried", 1 / 28), ("windows, a 16th carried", 1 / 16)):
                windows.CARRIED_FRACTION = fraction
                plan = windows.WindowedPlan(loads, config, seed, 0, size=4_000_000)
                balance = plan.epoch_balance()
                plan.close()
                results.setdefault(label, []).append([balance["vit_dist"], balance["llm_dist"]])
    finally:
        windows.CARRIED_FRACTION = kept
    print("\n[carry] plan | mean ViT Dist | mean LLM Dist | per seed (ViT, LLM) x 1e6")
    for label, values in results.items():
        mean = np.mean(values, axis=0)
        print(f"[carry] {label} | {mean[0]:.3g} | {mean[1]:.3g} | {np.round(np.array(values) * 1e6, 2).tolist()}")
    assert len(results) == 5
