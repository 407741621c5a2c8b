"""Hugging Face VLMs on one GPU in bf16: packs against padded batches. Skips without CUDA.

Run (on a machine with a GPU): .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_hf_gpu.py -m benchmark

1. Attention: forward + backward of a Qwen2-VL language model (about 0.5 B parameters, bf16 autocast) over the
   same samples four ways: each sample alone, a padded batch (HF's usual collation: right-padded to the
   longest, an attention mask, sdpa), the pack with HF's packed sdpa (a dense L x L block mask from the
   restarting positions) and the pack with Packfeed's variable-length attention (sdpa per sample, which takes
   torch's flash-attention kernel in bf16). Median step and its spread over the repeats, peak CUDA memory.
2. Training: `packfeed train model.hf=qwen2_vl parallel.pp=1 parallel.precision=bf16` on the demo photographs,
   one epoch each of isf+balance packs, random packs and padded batches of random samples
   (`data.collate=padded`), interleaved over two rounds: epoch time, median step, tokens/s, padding, peak memory.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from test_bench_packed_attention import text_pack  # noqa: E402
from trainer_workers import packfeed_train  # noqa: E402

pytestmark = [pytest.mark.benchmark, pytest.mark.timeout(3600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB = 32_000
TEXT = {"hidden_size": 1536, "intermediate_size": 4096, "num_hidden_layers": 12, "num_attention_heads": 12,
        "num_key_value_heads": 4}
LENGTH_SETS = {"8 x 1,024": [1024] * 8,
               "16 samples, 90-3,900 (long tail)": [90, 3900, 240, 1700, 130, 610, 2600, 180, 950, 300, 1300, 75,
                                                    460, 2100, 220, 780]}
REPEATS = int(os.environ.get("PACKFEED_BENCH_REPEATS", 8))


def conventions():
    from packfeed.v1 import packfeed_pb2 as pb

    policy = pb.ImagePolicy(name="qwen2vl", patch_size=14, parameters_json='{"factor": 28}')
    return pb.ModelConventions(image_policy=policy, vocab_size=VOCAB, image_context_id=VOCAB - 1)


def packed_inputs(pack, attention: str, device) -> dict:
    from packfeed.client.model.hf import to_hf_inputs

    inputs = to_hf_inputs(pack, "qwen2_vl", attention=attention)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def padded_inputs(samples, device) -> dict:
    """HF's usual collation: right-padded to the longest sample, with an attention mask; the loss is the mean
    over the batch's loss tokens, as the pack's (num_items_in_batch) is."""
    longest = max(len(s.input_ids) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full((len(samples), longest), -100, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s.input_ids)
        ids[row, :n], labels[row, :n], mask[row, :n] = (torch.from_numpy(s.input_ids.astype(np.int64)),
                                                        torch.from_numpy(s.labels.astype(np.int64)), 1)
    items = int((labels[:, 1:] != -100).sum())
    return {"input_ids": ids.to(device), "labels": labels.to(device), "attention_mask": mask.to(device),
            "num_items_in_batch": items}


def timed(model, batches: list[dict], device: torch.device) -> tuple[float, float, float, float, float]:
    """(median, min, max) seconds of forward + backward over `batches`, peak MiB, and the summed loss."""
    cuda = device.type == "cuda"
    times, loss = [], 0.0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for repeat in range(REPEATS + 2):  # two warm-ups
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        loss = 0.0
        for inputs in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                out = model(**inputs).loss
            out.backward()
            loss += float(out.detach())
        if cuda:
            torch.cuda.synchronize()
        if repeat >= 2:
            times.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else float("nan")
    return statistics.median(times), min(times), max(times), peak, loss


def test_packs_against_padded_batches_attention_on_gpu(device: torch.device = torch.device("cuda")):
    from packfeed.client.model.hf import register_varlen_attention
    from packfeed.trainer.models.hf.build import build_hf_model

    varlen = register_varlen_attention()
    models = {impl: build_hf_model("qwen2_vl", conventions(), {"text": TEXT}, attention=impl).to(device).train()
              for impl in ("sdpa", varlen)}
    params = sum(p.numel() for p in models["sdpa"].parameters()) / 1e9
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"\n[gpu attention] {name}, torch {torch.__version__}; Qwen2-VL LLM {TEXT}, "
          f"{params:.2f} B parameters, bf16 autocast, median of {REPEATS} (min-max)")
    for name, lengths in LENGTH_SETS.items():
        pack, samples = text_pack(lengths, len(lengths), VOCAB)
        ways = {"per-sample loop": (models["sdpa"], [padded_inputs([s], device) for s in samples]),
                "padded batch (sdpa, mask)": (models["sdpa"], [padded_inputs(samples, device)]),
                "pack, HF sdpa (dense mask)": (models["sdpa"], [packed_inputs(pack, "sdpa", device)]),
                "pack, Packfeed varlen (flash)": (models[varlen], [packed_inputs(pack, "varlen", device)])}
        tokens = sum(lengths)
        results = {way: timed(model, batches, device) for way, (model, batches) in ways.items()}
        base = results["padded batch (sdpa, mask)"][0]
        print(f"[gpu attention] {name}: {tokens:,} tokens, padded batch {len(lengths)} x {max(lengths):,} = "
              f"{len(lengths) * max(lengths):,} slots")
        for way, (median, low, high, peak, _) in results.items():
            print(f"[gpu attention]   {way:<30} {median * 1e3:8.1f} ms ({low * 1e3:.1f}-{high * 1e3:.1f})  "
                  f"{tokens / median:10,.0f} tokens/s  peak {peak:8,.0f} MiB  {base / median:.2f}x the padded batch")
        # the per-sample loop means each sample's loss; the others the batch's token mean: compare those three
        losses = [results[w][4] for w in ways if w != "per-sample loop"]
        assert max(losses) - min(losses) < 0.05 * abs(losses[0]), losses
        assert results["pack, Packfeed varlen (flash)"][0] < results["pack, HF sdpa (dense mask)"][0]


SIZES = ("{text: {hidden_size: 1536, intermediate_size: 4096, num_hidden_layers: 12, num_attention_heads: 12, "
         "num_key_value_heads: 4}, vision: {embed_dim: 1024, num_heads: 16, depth: 12}}")
SAMPLES = int(os.environ.get("PACKFEED_BENCH_SAMPLES", 320))  # a shorter run where device time is short
ROUNDS = int(os.environ.get("PACKFEED_BENCH_ROUNDS", 2))


@pytest.fixture(scope="module")
def qwen_index(tmp_path_factory) -> Path:
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("bench-hf-gpu")

    def packfeed(*args: str) -> None:
        done = subprocess.run([sys.executable, "-m", "packfeed.cli", *args], cwd=root, capture_output=True,
                              text=True)
        assert done.returncode in (0, 3), done.stderr[-2000:]  # 3: the demo's broken samples were skipped

    packfeed("demo", "--out", "demo-out", "--dataset-only", "--samples", str(SAMPLES))
    packfeed("index", "demo-out/shards/*.tar", "--tokenizer", "demo-out/tokenizer.json", "--preset", "qwen2_vl",
             "--max-pixels", "200704", "--extend-tokenizer", "--out", "index.parquet")
    return root / "index.parquet"


def summary(run: list[dict]) -> dict:
    seconds = sum(r["step_s"] for r in run)
    tokens = sum(r["tokens"] for r in run)
    return {"steps": len(run), "epoch_s": seconds, "step_s": [r["step_s"] for r in run[1:]],
            "tokens_per_s": tokens / seconds, "pad": 1 - tokens / sum(r["padded_tokens"] for r in run),
            "peak_mib": max(r["peak_memory_mib"] for r in run)}


def test_vlm_epoch_packs_against_padded_batches_on_gpu(qwen_index, tmp_path):
    settings = {"isf+balance packs": ("isf+balance", "packed"), "random packs": ("random", "packed"),
                "padded batches": ("random", "padded")}
    print(f"\n[gpu vlm] {torch.cuda.get_device_name()}: Qwen2-VL {SIZES}, {SAMPLES} demo photographs (at most 256 "
          f"LLM tokens an image), M 4, bf16, one process; one epoch per run, interleaved")
    print("[gpu vlm] run | data | steps | epoch s | median step ms (min-max, after the first) | tokens/s | padding | "
          "peak MiB")
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    for round_ in range(ROUNDS):
        for name in settings if round_ == 0 else reversed(settings):
            strategy, collate = settings[name]
            overrides = ["model.hf=qwen2_vl", f"model.hf_config={SIZES}", f"data.index={qwen_index}",
                         "parallel.pp=1", "parallel.precision=bf16", "data.microbatches=4", "data.server_workers=8",
                         "data.prefetch=8", "data.epochs=1", "optim.steps=0", "optim.warmup_steps=1",
                         f"data.strategy={strategy}", f"data.collate={collate}", "recompute.mode=none"]
            _, records = packfeed_train(1, overrides, tmp_path / f"{round_}-{name.replace(' ', '-')}", timeout=900)
            s = summary(records)
            runs[name].append(s)
            print(f"[gpu vlm] {round_} | {name} | {s['steps']} | {s['epoch_s']:.2f} | "
                  f"{statistics.median(s['step_s']) * 1e3:.0f} ({min(s['step_s']) * 1e3:.0f}-"
                  f"{max(s['step_s']) * 1e3:.0f}) | {s['tokens_per_s']:,.0f} | {s['pad']:.1%} | {s['peak_mib']:,.0f}",
                  flush=True)
    epochs = {name: statistics.median(s["epoch_s"] for s in rounds) for name, rounds in runs.items()}
    for name, value in epochs.items():
        print(f"[gpu vlm] {name}: median epoch {value:.2f} s, {value / epochs['isf+balance packs']:.2f}x the "
              f"isf+balance epoch time")
    assert runs["padded batches"][0]["pad"] > runs["isf+balance packs"][0]["pad"]
