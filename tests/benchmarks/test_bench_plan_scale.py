"""Planner scale: the whole `packfeed plan` process on an InternVL-1.2M-like mix at 1.2M and 10M samples,
and 100M with PACKFEED_BENCH_100M=1 (several minutes, about 7 GB).

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_plan_scale.py -m benchmark
Prints wall time of the whole process (interpreter start, imports, reading the index, automatic caps,
ISF, balancing, writing plan.parquet) and its peak RSS, from /usr/bin/time. Numba compiles once per
machine and caches; the first (cold) run after the index is written is reported separately.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from internvl_mix import write_mix_index

pytestmark = pytest.mark.benchmark
SIZES = [1_200_000, 10_000_000] + ([100_000_000] if os.environ.get("PACKFEED_BENCH_100M") else [])


def run_plan(index, out):
    packfeed = os.path.join(os.path.dirname(sys.executable), "packfeed")
    done = subprocess.run(["/usr/bin/time", "-f", "TIME %e %M", packfeed, "plan", "--index", str(index), "--dp", "8",
                           "--out", str(out)], capture_output=True, text=True, check=True)
    wall, peak_kib = re.search(r"TIME ([\d.]+) (\d+)", done.stderr).groups()
    return float(wall), int(peak_kib) / 1024 ** 2, json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not shutil.which("/usr/bin/time"), reason="needs /usr/bin/time (Debian package 'time')")
@pytest.mark.parametrize("n", SIZES)
def test_plan_process_scale(tmp_path, n):
    index = write_mix_index(n, tmp_path / f"mix-{n}.parquet")
    cold = run_plan(index, tmp_path / "cold.parquet")
    runs = [run_plan(index, tmp_path / f"warm{k}.parquet") for k in range(3 if n < 50_000_000 else 1)]
    best = min(runs, key=lambda r: r[0])
    s = best[2]
    print(f"\n[plan scale] n={n:,} cold={cold[0]:.2f}s warm(best)={best[0]:.2f}s warm all="
          f"{[r[0] for r in runs]} in-process planning={s['planning_seconds']:.2f}s "
          f"peak RSS={max(r[1] for r in runs + [cold]):.2f} GiB")
    print(f"[plan scale] packs={s['packs']:,} steps={s['steps']:,} samples/pack={s['samples_per_pack']} "
          f"caps={s['caps']} ViT Dist={s['vit_dist']} LLM Dist={s['llm_dist']} cpu={os.cpu_count()}")
    assert s["samples"] == n
