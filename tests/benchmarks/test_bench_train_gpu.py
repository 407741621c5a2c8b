"""The reference trainer on one GPU: step times and memory on CUDA. Skips without CUDA.

Run (on a machine with a GPU): .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_train_gpu.py -m benchmark

One GPU holds one pipeline stage per process (NCCL refuses two ranks on one device), so the whole model is one
stage: `packfeed train --nproc 1 parallel.pp=1`, bf16 autocast, fed by an embedded server. The data are demo
samples (real photographs) tiled the InternVL way (448 px tiles, 256 tokens each, up to 6 tiles + thumbnail).
1. Data strategies: one epoch each of random packs, ISF, ISF + balance, no recompute; epoch time (sum of step
   times), median step, tokens/s, padding, peak CUDA memory per step.
2. Recompute on CUDA memory statistics: none, all, and adaptive with a budget halfway between the two peaks
   measured in 1; the chooser's plan, its peak and its step time.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from demo_data import indexed_demo
from trainer_workers import packfeed_train

pytestmark = [pytest.mark.benchmark,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STRATEGIES = ("random", "isf", "isf+balance")
MODEL = {"vit_dim": 1024, "vit_layers": 12, "vit_heads": 16, "llm_dim": 2048, "llm_layers": 12,
         "llm_heads": 16, "patch_size": 14, "ffn_multiple": 256, "seed": 0}  # SwiGLU 5,632 wide: tensor-core aligned
POLICY = {"name": "internvl", "image_size": 448, "tokens_per_tile": 256, "max_num": 6}
SAMPLES = 480  # strategies: one epoch each
RECOMPUTE_SAMPLES = 160  # recompute: each run trains an epoch of these (its own, smaller dataset)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return indexed_demo(tmp_path_factory.mktemp("bench-train-gpu"), SAMPLES, 8, 5, POLICY)[1]


@pytest.fixture(scope="module")
def small_dataset(tmp_path_factory):
    return indexed_demo(tmp_path_factory.mktemp("bench-recompute-gpu"), RECOMPUTE_SAMPLES, 4, 6, POLICY)[1]


def train_epoch(index: Path, out: Path, strategy: str, *extra: str) -> list[dict]:
    overrides = [f"data.index={index}", f"data.strategy={strategy}", "data.microbatches=4", "data.job=bench",
                 "data.server_workers=8", "data.prefetch=8", "parallel.pp=1", "parallel.precision=bf16",
                 "optim.steps=0", *extra] + [f"model.{k}={v}" for k, v in MODEL.items()]
    log, records = packfeed_train(1, overrides, out, timeout=1200)
    print("\n".join(line for line in log.splitlines() if "recompute" in line))
    return records


def summary(records: list[dict]) -> dict:
    total = sum(r["step_s"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    return {"steps": len(records), "epoch_s": total, "median_ms": 1e3 * float(np.median([r["step_s"] for r in records])),
            "wait_s": sum(r["data_wait_s"] for r in records), "tokens_per_s": tokens / total,
            "pad": 1 - tokens / sum(r["padded_tokens"] for r in records),
            "peak_mib": max(r["peak_memory_mib"] for r in records), "loss": records[-1]["loss"]}


def print_row(name: str, s: dict, base: float) -> None:
    print(f"[gpu] {name} | {s['steps']} | {s['epoch_s']:.2f} | {s['median_ms']:.0f} | {s['wait_s']:.2f} | "
          f"{s['tokens_per_s']:,.0f} | {s['pad']:.1%} | {s['peak_mib']:,.0f} | {base / s['epoch_s']:.2f}x")


HEADER = "[gpu] run | steps | epoch s | median step ms | data wait s | tokens/s | padding | peak MiB | speedup"


def test_strategies_on_gpu(dataset, tmp_path):
    print(f"\n[gpu] {torch.cuda.get_device_name()}, torch {torch.__version__}; model {MODEL}; "
          f"{SAMPLES} demo samples, M 4, bf16, one process")
    print(HEADER)
    runs = {s: summary(train_epoch(dataset, tmp_path / s.replace("+", "_"), s, "recompute.mode=none"))
            for s in STRATEGIES}
    for name, s in runs.items():
        print_row(name, s, runs["random"]["epoch_s"])
    assert runs["isf+balance"]["pad"] < runs["random"]["pad"]


def test_recompute_on_gpu(small_dataset, tmp_path):
    none = summary(train_epoch(small_dataset, tmp_path / "none", "isf+balance", "recompute.mode=none"))
    full = summary(train_epoch(small_dataset, tmp_path / "all", "isf+balance", "recompute.mode=all"))
    budget = (full["peak_mib"] + none["peak_mib"]) / 2
    adaptive = summary(train_epoch(small_dataset, tmp_path / "adaptive", "isf+balance", "recompute.mode=adaptive",
                                   f"recompute.budget_mb={budget:.0f}"))
    print(f"\n[gpu] recompute, isf+balance, {RECOMPUTE_SAMPLES} demo samples (adaptive budget {budget:,.0f} MiB)")
    print(HEADER)
    for name, s in (("none", none), ("all", full), ("adaptive", adaptive)):
        print_row(f"recompute {name}", s, none["epoch_s"])
    plan = json.loads((tmp_path / "adaptive" / "recompute-stage0.json").read_text())
    print(f"[gpu] adaptive plan: {plan}")
    assert full["peak_mib"] < none["peak_mib"]
