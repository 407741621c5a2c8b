"""Mixtures whose weights move (issue [6/6]): do packs stay balanced, and what does a window cost to plan?

1. The two InternVL-1.2M subsets in ../shared/data/lengths (ai2d 12,413 and chartqa 18,317 valid samples) mixed
   two ways over the same 30,730-sample epoch, isf+balance, DP 8 and DP 64, windows of 4,000 and 10,000 samples,
   seeds 0-2: a moving mixture (ai2d 80% -> 20%, chartqa 20% -> 80%, linear) and, on the same data, the fixed
   mixture whose repeats draw the same samples per dataset over the epoch (its windows cutting the epoch's
   permutation, so each window has the epoch's mix). Per plan: ViT and LLM Dist over every step, the packs' fill (LLM tokens and
   vision units over the caps, over every non-empty pack) and the steps.
2. Planning time per window at 10M samples: two InternVL-like datasets of 5M samples each, windows of 100,000 and
   1,000,000, every window planned in order (as a server does), fixed against moving in the same run; median and
   range over the windows.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_moving_mixture.py -m benchmark
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from internvl_mix import internvl_like_mix
from packfeed.server.index.lengths import index_from_lengths, write_lengths_index
from packfeed.server.mixture.loads import MixtureLoads
from packfeed.server.mixture.mixture_file import Mixture
from packfeed.v1.options import PlanConfig

pytestmark = pytest.mark.benchmark
LENGTHS = Path(__file__).resolve().parents[3] / "shared" / "data" / "lengths"
MOVING = {"ai2d": {0.0: 0.8, 1.0: 0.2}, "chartqa": {0.0: 0.2, 1.0: 0.8}}


def mixture_files(folder: Path, indexes: dict[str, Path], repeats: dict[str, float] | None = None,
                  samples: int | None = None) -> tuple[Path, Path]:
    fixed = {"name": "fixed", "datasets": {name: {"index": str(path), "repeat": (repeats or {}).get(name, 1)}
                                           for name, path in indexes.items()}}
    moving = {"name": "moving", "datasets": {name: {"index": str(path), "weights": MOVING[name]}
                                             for name, path in indexes.items()},
              **({"samples": samples} if samples else {})}
    paths = folder / "fixed.yaml", folder / "moving.yaml"
    for path, content in zip(paths, (fixed, moving)):
        path.write_text(yaml.safe_dump(content))
    return paths


def balance(mixture: MixtureLoads, config: PlanConfig, seed: int) -> dict[str, float]:
    plan = mixture.windowed(config, seed, 0)
    whole = plan.whole()
    vit_dist, llm_dist = whole.dists(plan.rows.loads)
    vision, llm = whole.pack_loads(plan.rows.loads)
    used = llm > 0
    plan.close()
    return {"vit_dist": vit_dist, "llm_dist": llm_dist, "steps": whole.n_steps,
            "llm_fill": float(llm[used].sum() / (used.sum() * whole.caps.token_cap)),
            "vit_fill": float(vision[used].sum() / (used.sum() * whole.caps.vision_cap))}


def spread(values: list[float], digits: int = 4) -> str:
    return f"{np.median(values):.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def test_a_moving_mixture_is_as_balanced_as_a_fixed_one(tmp_path):
    files = {"ai2d": LENGTHS / "ai2d_train_12k.json", "chartqa": LENGTHS / "chartqa_train_18k.json"}
    if not all(path.exists() for path in files.values()):
        pytest.skip(f"the length files are not under {LENGTHS}")
    indexes = {}
    for name, path in files.items():
        indexes[name] = tmp_path / f"{name}.parquet"
        index_from_lengths([path], indexes[name])
    _, moving_file = mixture_files(tmp_path, indexes)
    moving = MixtureLoads(Mixture.load(moving_file), None, mapped=True)
    # the baseline draws the same samples per dataset over the epoch, at a fixed rate: repeat = drawn / valid
    rows, _ = moving.drawn_epoch(PlanConfig(dp=8, window=4_000), 0, 0)
    drawn = rows.counts(np.arange(len(rows.datasets)))
    repeats = {name: drawn[name] / len(valid) for name, valid in zip(rows.names, moving.valid)}
    fixed_file, _ = mixture_files(tmp_path, indexes, repeats)
    mixtures = {"fixed": MixtureLoads(Mixture.load(fixed_file), None, mapped=True), "moving": moving}
    print(f"\n[moving mixture] drawn over the epoch: {drawn}; the fixed mixture's repeats: "
          f"{ {name: round(r, 4) for name, r in repeats.items()} }")
    for dp, window in ((8, 4_000), (64, 4_000), (64, 10_000)):
        config = PlanConfig(dp=dp, window=window)
        results = {kind: [balance(mixture, config, seed) for seed in range(3)] for kind, mixture in mixtures.items()}
        for kind, rows in results.items():
            print(f"[moving mixture] DP {dp:2d}, window {window:,}, {kind:6s}: ViT Dist {spread([r['vit_dist'] for r in rows])}, "
                  f"LLM Dist {spread([r['llm_dist'] for r in rows])}, LLM fill {spread([r['llm_fill'] for r in rows], 3)}, "
                  f"ViT fill {spread([r['vit_fill'] for r in rows], 3)}, steps {spread([r['steps'] for r in rows], 0)} "
                  "(median [min, max] over seeds 0-2)")
        for rows in results.values():
            assert all(r["llm_fill"] > 0.5 for r in rows)


def test_planning_time_per_window_at_ten_million_samples(tmp_path):
    indexes = {}
    for k, name in enumerate(("ai2d", "chartqa")):
        vision, tokens = internvl_like_mix(5_000_000, seed=k)
        indexes[name] = tmp_path / f"{name}.parquet"
        write_lengths_index(vision, tokens, vision, indexes[name], [name], np.zeros(len(vision), np.int32))
    fixed_file, moving_file = mixture_files(tmp_path, indexes)
    print()
    for window in (100_000, 1_000_000):
        config = PlanConfig(dp=64, window=window)
        for kind, path in (("fixed", fixed_file), ("moving", moving_file)):
            started = time.perf_counter()
            mixture = MixtureLoads(Mixture.load(path), None, mapped=True)
            plan = mixture.windowed(config, 0, 0)
            setup = time.perf_counter() - started
            seconds = []
            for w in range(plan.n_windows):  # in order, as a server plans them, without its planning ahead
                started = time.perf_counter()
                plan._plan_window(w)  # the draw of a moving mixture's window included
                seconds.append(time.perf_counter() - started)
            first, seconds = seconds[0], seconds[1:]  # window 0 also searches the caps
            plan.close()
            print(f"[moving mixture] 10M samples, window {window:,} ({plan.n_windows} windows), {kind:6s}: setup "
                  f"{setup:.2f} s, window 0 (caps searched) {first:.2f} s, each later window "
                  f"{spread(seconds, 3)} s (median [min, max])")
            assert seconds and max(seconds) < 120
