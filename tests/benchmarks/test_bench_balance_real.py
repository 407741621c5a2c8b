"""Balance on the real data: both InternVL-1.2M subsets (30,730 samples), DP 8, one pack per rank per step,
at the caps OmniBal's own search picks (16 tiles, 5376 tokens, token target 5248).

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_balance_real.py -m benchmark
"""

from __future__ import annotations

import time

import pytest

from packfeed.server.plan.caps import search_caps
from packfeed.server.plan.costs import load_sample_loads
from packfeed.server.plan.planner import make_plan
from packfeed.v1.options import PlanConfig, Strategy

pytestmark = pytest.mark.benchmark


def test_real_data_table(real_index):
    loads, _ = load_sample_loads(real_index)
    started = time.perf_counter()
    caps, tried = search_caps(loads.vision, loads.tokens, dp=8, samples_per_pack=4, iterations=10)
    search_s = time.perf_counter() - started
    print(f"\n[balance] automatic caps: {caps} from {len(tried)} candidates in {search_s:.3f} s")
    print("[balance] strategy | samples/pack | packs | steps | Pad | ViT Dist | LLM Dist | plan s (best of 5)")
    for strategy in Strategy:
        config = PlanConfig(dp=8, strategy=strategy, vision_cap=16, token_cap=5376, token_target=5248)
        runs = [make_plan(loads, config, seed, 0) for seed in range(5)]
        s = [r.summary(loads) for r in runs]
        mean = {k: sum(x[k] for x in s) / len(s) for k in ("vit_dist", "llm_dist", "pad_ratio", "packs")}
        print(f"[balance] {strategy} | {s[0]['samples_per_pack']:.2f} | {s[0]['packs']} | {s[0]['steps']} | "
              f"{mean['pad_ratio']:.3f} | {mean['vit_dist']:.5f} | {mean['llm_dist']:.5f} | "
              f"{min(r.seconds for r in runs):.4f}  (Dist/Pad: mean over seeds 0-4; packs seed 0, "
              f"mean {mean['packs']:.0f})")
    assert caps.vision_cap == 16
