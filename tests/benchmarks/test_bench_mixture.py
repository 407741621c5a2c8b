"""The planner on a mixture: 20 datasets of an InternVL-1.2M-like mix, 1.2M samples in all, with repeats from
0.3 to 2, planned at DP 8 (isf+balance, automatic caps); against the same samples as one index, in one run.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_mixture.py -m benchmark
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import yaml

from internvl_mix import internvl_like_mix
from packfeed.server.index.lengths import write_lengths_index
from packfeed.server.mixture.loads import MixtureLoads, make_mixture_plan
from packfeed.server.mixture.mixture_file import Mixture
from packfeed.server.plan.costs import load_sample_loads
from packfeed.server.plan.planner import make_plan
from packfeed.v1.options import PlanConfig

pytestmark = pytest.mark.benchmark
DATASETS, TOTAL = 20, 1_200_000


def test_planning_a_twenty_dataset_mixture(tmp_path):
    rng = np.random.default_rng(0)
    sizes = rng.multinomial(TOTAL - DATASETS * 5000, np.ones(DATASETS) / DATASETS) + 5000
    repeats = np.round(rng.choice([0.3, 0.5, 1, 1, 1, 1.5, 2], DATASETS), 2)
    everything = []
    datasets = {}
    for k, n in enumerate(sizes):
        vision, tokens = internvl_like_mix(int(n), seed=k)
        everything.append((vision, tokens))
        write_lengths_index(vision, tokens, vision, tmp_path / f"d{k}.parquet", [f"d{k}"], np.zeros(n, np.int32))
        datasets[f"d{k}"] = {"index": f"d{k}.parquet", "repeat": float(repeats[k])}
    (tmp_path / "mix.yaml").write_text(yaml.safe_dump({"name": "mix20", "datasets": datasets}))
    vision = np.concatenate([v for v, _ in everything])
    tokens = np.concatenate([t for _, t in everything])
    write_lengths_index(vision, tokens, vision, tmp_path / "all.parquet", ["all"], np.zeros(len(vision), np.int32))
    config = PlanConfig(dp=8)

    started = time.perf_counter()
    mixture = MixtureLoads(Mixture.load(tmp_path / "mix.yaml"))
    read_s = time.perf_counter() - started
    rows = []
    for epoch in range(3):
        started = time.perf_counter()
        plan = make_mixture_plan(mixture, config, 0, epoch)
        rows.append((time.perf_counter() - started, plan.summary(plan.rows.loads)))
    started = time.perf_counter()
    loads, info = load_sample_loads(tmp_path / "all.parquet")
    single = make_plan(loads, config, 0, 0, info.fingerprint)
    single_s = time.perf_counter() - started
    s = single.summary(loads)
    for epoch, (seconds, summary) in enumerate(rows):
        print(f"\n[mixture] epoch {epoch}: {summary['samples']:,} rows (repeats applied) planned in {seconds:.2f} s "
              f"(automatic caps included; epoch 0 also warms up); packs {summary['packs']:,}, ViT Dist {summary['vit_dist']}, "
              f"LLM Dist {summary['llm_dist']}")
    print(f"[mixture] reading 20 indexes: {read_s:.2f} s; one index of the same {len(loads):,} samples: planned in "
          f"{single_s:.2f} s (read + caps + plan), ViT Dist {s['vit_dist']}, LLM Dist {s['llm_dist']}")
    print(f"[mixture] repeats: {repeats.tolist()}")
    assert rows[0][1]["samples"] == sum(int(r // 1) * int(n) + round((r % 1) * int(n)) for r, n in zip(repeats, sizes))
