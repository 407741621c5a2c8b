"""What reporting a step's loss per dataset costs a trainer (`PackfeedTrainer` on a loss-driven mixture, issue [6/6]):
`token_losses` (each target's next-token loss, chunked) plus `sums_by_dataset` over one pack's logits, against the
loss the model computes from those same logits anyway (transformers' `ForCausalLMLoss`, what a Qwen2-VL forward
with labels runs). CPU, float32 logits of a Qwen2-VL-2B-sized vocabulary (151,936), packs of 2,048 tokens holding
8 samples of two datasets, 60% of tokens in the loss; the median and spread of 7 rounds each, interleaved.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_dataset_losses.py -m benchmark
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest
import torch

from packfeed.client.model.dataset_losses import sums_by_dataset, token_losses
from packfeed.client.stream.tensors import IGNORE_INDEX, PackTensors

pytestmark = pytest.mark.benchmark
VOCAB, LENGTH, SAMPLES, ROUNDS = 151_936, 2_048, 8, 7


def pack_and_logits(seed: int = 0) -> tuple[PackTensors, torch.Tensor]:
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(rng.integers(0, VOCAB, LENGTH).astype(np.int32))
    labels = torch.where(torch.from_numpy(rng.random(LENGTH) < 0.6), ids, torch.tensor(IGNORE_INDEX, dtype=torch.int32))
    bounds = torch.linspace(0, LENGTH, SAMPLES + 1).round().to(torch.int32)
    pack = PackTensors(0, 0, 0, 0, False, [f"s{k}" for k in range(SAMPLES)], int((labels != IGNORE_INDEX).sum()), 0, [],
                       {"input_ids": ids, "labels": labels, "cu_seqlens": bounds,
                        "position_ids": torch.arange(LENGTH, dtype=torch.int32)},
                       sample_sources=["ocr", "chat"] * (SAMPLES // 2))
    logits = torch.from_numpy(rng.standard_normal((LENGTH, VOCAB), dtype=np.float32))
    return pack, logits


def test_reporting_costs_little_beside_the_models_own_loss():
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.set_num_threads(2)
    pack, logits = pack_and_logits()
    labels = pack.labels.long()
    own, ours = [], []
    for _ in range(ROUNDS):
        started = time.perf_counter()
        loss = ForCausalLMLoss(logits[None], labels[None], VOCAB)
        own.append(time.perf_counter() - started)
        started = time.perf_counter()
        sums = sums_by_dataset(pack, *token_losses(logits, labels))
        ours.append(time.perf_counter() - started)
    total = sum(value for value, _ in sums.values())
    tokens = sum(count for _, count in sums.values())
    assert total / tokens == pytest.approx(float(loss), rel=1e-4)  # the same tokens, the same mean
    for name, times in (("the model's own loss (ForCausalLMLoss)", own), ("per-dataset report", ours)):
        print(f"{name}: median {statistics.median(times) * 1e3:.0f} ms, min {min(times) * 1e3:.0f}, "
              f"max {max(times) * 1e3:.0f} ms over {ROUNDS} rounds")
    print(f"report / own loss: {statistics.median(ours) / statistics.median(own):.2f}x")
