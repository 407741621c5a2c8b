"""Training on balanced packs (issue [3/4]): the same model, data and epoch under three data strategies, measured
on CPU, then a pipeline simulator calibrated from the measured layer costs, checked against the measured
steps and run at cluster scale on the real InternVL-1.2M length distribution.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_train.py -m benchmark

1. Measured: `packfeed train --nproc 2` (2 pipeline stages, gloo, M = 4) with an embedded server, one epoch of
   the same 200 demo samples per strategy — random packs of 4 samples, ISF, ISF + balance + 1F1B reordering;
   no recompute. Round 1: each run searches its own partition (the whole system); round 2, in reverse order:
   every strategy on round 1's ISF+balance partition (the data alone). Epoch training time (sum of step
   times), tokens/s, data wait, padding, measured bubble; the loss curves go to BENCHMARKS_loss.png.
2. Simulator check: the layer costs profiled by those runs, fitted per layer as c0 + c1 n + c2 q, predict every
   measured step from its padded microbatches; mean relative error against the measured compute time.
3. Cluster scale: the same costs on the real length files (30,730 samples) at DP 8 x PP 4, M 8 — simulated step
   time, bubble fraction and speedup per strategy.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from demo_data import indexed_demo
from packfeed.trainer.parallel.profile import LayerProfile
from packfeed.trainer.simulate.calibrated import (
    Features,
    fit_layer_costs,
    padded_features,
    simulate_pipeline,
    simulate_step,
    stage_times,
)
from trainer_workers import packfeed_train

pytestmark = pytest.mark.benchmark

STRATEGIES = ("random", "isf", "isf+balance")
MODEL = {"vit_dim": 48, "vit_layers": 3, "llm_dim": 96, "llm_layers": 3, "patch_size": 14, "seed": 0}
POLICY = {"name": "internvl", "image_size": 224, "tokens_per_tile": 64, "max_num": 6}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return indexed_demo(tmp_path_factory.mktemp("bench-train"), 200, 4, 5, POLICY)[1]


def train_epoch(index: Path, strategy: str, out: Path, bounds: list[int] | None = None) -> dict:
    partition = [f"partition.bounds=[{','.join(map(str, bounds))}]"] if bounds else \
        ["partition.top_k=2", "partition.trial_steps=1"]
    overrides = [f"data.index={index}", f"data.strategy={strategy}", "data.microbatches=4", "data.job=bench",
                 "data.server_workers=1", "data.prefetch=4", "parallel.pp=2", "recompute.mode=none",
                 "optim.steps=0", *partition] + [f"model.{k}={v}" for k, v in MODEL.items()]
    _, records = packfeed_train(2, overrides, out, timeout=1200)
    partition = json.loads((out / "partition.json").read_text()) if not bounds else {"bounds": bounds}
    return {"records": records, "partition": partition}


def summarise(strategy: str, run: dict) -> dict:
    records = run["records"]
    total = sum(r["step_s"] for r in records)
    wait = sum(r["data_wait_s"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    padded = sum(r["padded_tokens"] for r in records)
    return {"strategy": strategy, "steps": len(records), "epoch_s": total, "wait_s": wait,
            "compute_s": total - wait, "tokens_per_s": tokens / total, "pad": 1 - tokens / padded,
            "bubble": float(np.mean([r["bubble_fraction"] for r in records])),
            "bounds": run["partition"]["bounds"]}


def calibrate(runs: dict[str, dict]):
    """Fit layer costs on every run's profiled microbatches together (varied sizes)."""
    profiles, features = None, []
    for run in runs.values():
        layers = [LayerProfile(**q) for q in run["partition"]["profile"]]
        features += [Features(**f) for f in run["partition"]["profile_features"]]
        if profiles is None:
            profiles = layers
        else:
            for mine, theirs in zip(profiles, layers):
                mine.per_microbatch = list(mine.per_microbatch) + list(theirs.per_microbatch)
    return fit_layer_costs(profiles, features)


def print_measured(title: str, runs: dict[str, dict]) -> list[dict]:
    rows = [summarise(s, runs[s]) for s in STRATEGIES]
    base = rows[0]["epoch_s"]
    print(f"[train] {title}")
    print("[train] strategy | steps | epoch s | of which data wait | tokens/s | padding | bubble (measured) | "
          "speedup vs random | partition")
    for r in rows:
        print(f"[train] {r['strategy']} | {r['steps']} | {r['epoch_s']:.1f} | {r['wait_s']:.1f} | "
              f"{r['tokens_per_s']:.0f} | {r['pad']:.1%} | {r['bubble']:.1%} | {base / r['epoch_s']:.2f}x | "
              f"{r['bounds']}")
    return rows


def test_training_strategies_measured_and_simulated(dataset, tmp_path, real_index):
    print("\n[train] measured on CPU, PP 2 x DP 1, M 4, one epoch of 200 demo samples (2 cores shared by 2 stages "
          "and the server's worker)")
    runs = {s: train_epoch(dataset, s, tmp_path / s.replace("+", "_")) for s in STRATEGIES}
    rows = print_measured("round 1: each strategy with its own partition search", runs)
    common = runs["isf+balance"]["partition"]["bounds"]
    fixed = {s: train_epoch(dataset, s, tmp_path / f"fixed-{s.replace('+', '_')}", common)
             for s in reversed(STRATEGIES)}
    rows += print_measured(f"round 2 (reverse order): every strategy on partition {common}", fixed)

    costs = calibrate(runs)
    errors = []
    for strategy in STRATEGIES:
        bubbles = []
        measured_steps = [(runs[strategy]["partition"]["bounds"], r) for r in runs[strategy]["records"]] + \
            [(common, r) for r in fixed[strategy]["records"]]
        for bounds, record in measured_steps:
            simulated = simulate_pipeline(*stage_times(costs, bounds, [Features(**f) for f in record["microbatches"]]))
            measured = record["step_s"] - record["data_wait_s"]
            errors.append((simulated.step_s - measured) / measured)
            bubbles.append(simulated.bubble_fraction)
        print(f"[train] {strategy}: simulated bubble of the measured steps {np.mean(bubbles):.1%}")
    errors = np.array(errors)
    print(f"[train] simulator vs measured compute per step ({len(errors)} steps): mean error {errors.mean():+.1%}, "
          f"mean |error| {np.abs(errors).mean():.1%}")

    cluster = simulate_cluster(costs, real_index)
    print("[train] simulated at DP 8 x PP 4, M 8 on the real lengths (30,730 samples), this model's measured costs")
    print("[train] strategy | steps | mean step s | epoch s | bubble | speedup vs random")
    for c in cluster:
        print(f"[train] {c['strategy']} | {c['steps']} | {c['step_s']:.3f} | {c['epoch_s']:.0f} | "
              f"{c['bubble']:.1%} | {cluster[0]['epoch_s'] / c['epoch_s']:.2f}x")
    plot_losses(runs)
    assert all(r["steps"] > 0 for r in rows)
    assert np.isfinite(errors).all()


def simulate_cluster(costs, real_index, dp: int = 8, stages: int = 4, m: int = 8) -> list[dict]:
    from packfeed.server.plan.costs import load_sample_loads
    from packfeed.server.plan.planner import make_plan
    from packfeed.v1.options import PlanConfig
    from packfeed.trainer.parallel.partition import split_by_weight

    loads, _ = load_sample_loads(real_index)
    typical = Features(8, 5000, 5 * 1000.0 ** 2)
    bounds = split_by_weight([sum(c.times(typical)) for c in costs], stages)
    out = []
    for strategy in STRATEGIES:
        plan = make_plan(loads, PlanConfig(dp=dp, microbatches=m, pipeline_stages=stages, strategy=strategy,
                                           vision_cap=16, token_cap=5376, token_target=5248), seed=0, epoch=0)
        total, busy = 0.0, 0.0
        for step in range(plan.n_steps):
            replicas = []
            for rank in range(dp):
                packs = [plan.pack(step, rank, j) for j in range(m)]
                replicas.append(padded_features([(int(loads.vision[p].sum()), loads.tokens[p].tolist())
                                                 for p in packs]))
            result = simulate_step(costs, bounds, replicas)
            total += result.step_s
            busy += result.busy_s
        out.append({"strategy": strategy, "steps": plan.n_steps, "step_s": total / plan.n_steps, "epoch_s": total,
                    "bubble": 1 - busy / (stages * total)})
    return out


def plot_losses(runs: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5))
    for strategy, run in runs.items():
        tokens = np.cumsum([r["tokens"] for r in run["records"]])
        axis.plot(tokens, [r["loss"] for r in run["records"]], marker=".", label=strategy)
    axis.set_xlabel("tokens trained on")
    axis.set_ylabel("loss (mean over the global step's loss tokens)")
    axis.set_title("Same data, same model: loss by data strategy")
    axis.legend()
    figure.tight_layout()
    path = REPO / "BENCHMARKS_loss.png"
    figure.savefig(path, dpi=110)
    print(f"[train] loss curves: {path}")
