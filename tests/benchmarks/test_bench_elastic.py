"""Elastic resume at scale: the InternVL-1.2M-like mix (1.2M samples), a job at DP 8 x M 4 stopped half way
through epoch 0, resumed at DP 4 and at DP 16. Prints the time to plan the epoch whole (the baseline, same
run), the time the re-plan takes (including the old plan it starts from, as a server computes it), and the
balance (ViT / LLM Dist) of the re-planned steps against a whole epoch planned at the new DP.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_elastic.py -m benchmark
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from internvl_mix import internvl_like_mix
from packfeed.server.plan.costs import SampleLoads
from packfeed.server.plan.metrics import dist_ratio
from packfeed.server.plan.planner import make_plan
from packfeed.server.plan.resume import consumed_samples, resume_plan
from packfeed.v1.options import PlanConfig

pytestmark = pytest.mark.benchmark


def rank_loads(plan, loads: SampleLoads) -> tuple[np.ndarray, np.ndarray]:
    """(ViT, LLM) load of every rank in every step, (steps, dp) each."""
    shape = (plan.n_steps, plan.config.dp, plan.config.microbatches)
    vision, tokens = (side.reshape(shape).sum(axis=2) for side in plan.pack_loads(loads))
    return vision, tokens


def test_resume_at_another_dp():
    loads = SampleLoads.from_arrays(*internvl_like_mix(1_200_000))
    old_config = PlanConfig(dp=8, microbatches=4)
    make_plan(loads, old_config, 0, 0)  # compiled and warm
    for _ in range(2):
        started = time.perf_counter()
        old = make_plan(loads, old_config, 0, 0)
        whole_s = time.perf_counter() - started
        vit, llm = rank_loads(old, loads)
        print(f"\n[elastic] whole epoch at DP 8 x M 4: {old.n_steps} steps planned in {whole_s:.2f} s, ViT Dist "
              f"{dist_ratio(vit):.2e}, LLM Dist {dist_ratio(llm):.2e}", end="")
        stop = old.n_steps // 2
        for dp in (4, 16):
            started = time.perf_counter()
            again = make_plan(loads, old_config, 0, 0)  # a server computes the old plan first
            resumed = resume_plan(loads, again, stop, PlanConfig(dp=dp, microbatches=4), 0, 0)
            resume_s = time.perf_counter() - started
            vit, llm = rank_loads(resumed, loads)
            fresh_vit, fresh_llm = rank_loads(make_plan(loads, PlanConfig(dp=dp, microbatches=4), 0, 0), loads)
            together = np.concatenate([consumed_samples(old, stop), resumed.members])
            assert len(together) == len(np.unique(together)) == int(loads.valid.sum())
            print(f"\n[elastic] stopped at step {stop}, resumed at DP {dp} x M 4: {resumed.n_steps} steps, old plan + "
                  f"re-plan in {resume_s:.2f} s ({resume_s / whole_s:.2f}x planning the epoch), ViT Dist "
                  f"{dist_ratio(vit):.2e}, LLM Dist {dist_ratio(llm):.2e} (a whole epoch planned at DP {dp}: "
                  f"{dist_ratio(fresh_vit):.2e}, {dist_ratio(fresh_llm):.2e})", end="")
