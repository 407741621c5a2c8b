"""Training on balanced packs: the same model, data and epoch under three data strategies, measured
on CPU (the simulator's check against such runs, and its cluster scale, are in test_bench_simulate.py).

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_train.py -m benchmark

1. Measured: `packfeed train --nproc 2` (2 pipeline stages, gloo, M = 4) with an embedded server, one epoch of
   the same 200 demo samples per strategy — random packs of 4 samples, ISF, ISF + balance + 1F1B reordering;
   no recompute. Round 1: each run searches its own partition (the whole system); round 2, in reverse order:
   every strategy on round 1's ISF+balance partition (the data alone). Epoch training time (sum of step
   times), tokens/s, data wait, padding, measured bubble; the loss curves go to BENCHMARKS_loss.png.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from demo_data import indexed_demo
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


def test_training_strategies_measured(dataset, tmp_path):
    print("\n[train] measured on CPU, PP 2 x DP 1, M 4, one epoch of 200 demo samples (2 cores shared by 2 stages "
          "and the server's worker)")
    runs = {s: train_epoch(dataset, s, tmp_path / s.replace("+", "_")) for s in STRATEGIES}
    rows = print_measured("round 1: each strategy with its own partition search", runs)
    common = runs["isf+balance"]["partition"]["bounds"]
    fixed = {s: train_epoch(dataset, s, tmp_path / f"fixed-{s.replace('+', '_')}", common)
             for s in reversed(STRATEGIES)}
    rows += print_measured(f"round 2 (reverse order): every strategy on partition {common}", fixed)

    plot_losses(runs)
    assert all(r["steps"] > 0 for r in rows)


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
