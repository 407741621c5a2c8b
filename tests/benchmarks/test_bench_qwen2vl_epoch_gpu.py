"""A Qwen2-VL-2B-sized model on one GPU in bf16: an epoch of a long-tailed mix as padded batches, random packs and
isf+balance packs. One command, under 8 minutes on an H100/H200; skips without CUDA.

Run (on a machine with a GPU): .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_qwen2vl_epoch_gpu.py -m benchmark

- The model: `transformers`' Qwen2VLForConditionalGeneration built from Qwen2-VL-2B's config (Packfeed's `2b`
  flavor: LLM 1,536 x 28 with 12 heads and 2 K/V heads, its 151,936-word vocabulary, the 1,280 x 32 vision
  tower), bf16 weights, no hub download. The samples are text: the LLM's work on each sample's real length
  (image tokens included, as text tokens); the vision tower is built but not run.
- The mix: `PACKFEED_BENCH_SAMPLES` (default 256) samples, 85% drawn (seeded) from the two InternVL-1.2M length
  files (294-1,611 tokens: image SFT) and 15% long ones, log-uniform in 2,048-4,096 tokens (multi-image and
  long conversations; made up here, the length files have none): a long tail.
- Three ways through the same samples, each one forward + backward per microbatch (no optimizer step: the
  same for all three):
  - isf+balance packs and random packs, as `packfeed plan` makes them (one GPU, 8,192 tokens a pack), with
    Packfeed's flash-attention varlen kernel (`register_varlen_attention`, `to_hf_inputs(..., "varlen")`);
  - padded batches, HF's collation: random samples, two a batch (2 x the longest sample = the packs' 8,192
    tokens: the same worst-case memory; as many as the packs hold ran out of the H200's memory), right-padded to
    the longer with an attention mask, sdpa (cuDNN's attention turned off, which builds a plan for every new
    length and would slow the baseline further).
- Two rounds, interleaved (A B C, then C B A) after a warm-up: epoch seconds, tokens/s (real tokens), padding,
  peak CUDA memory. `PACKFEED_BENCH_DEVICE=cpu PACKFEED_BENCH_SCALE=64` runs the same code on a CPU with a tiny
  model and every length divided by 64 (a check of the script, not a figure).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from test_bench_hf_gpu import padded_inputs  # noqa: E402
from test_bench_packed_attention import text_pack  # noqa: E402

DEVICE = os.environ.get("PACKFEED_BENCH_DEVICE", "cuda")
SCALE = int(os.environ.get("PACKFEED_BENCH_SCALE", 1))
SAMPLES = int(os.environ.get("PACKFEED_BENCH_SAMPLES", 256))
pytestmark = [pytest.mark.benchmark, pytest.mark.timeout(900),
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")]

LENGTHS = Path(__file__).resolve().parents[3] / "shared" / "data" / "lengths"
VOCAB = 151_936 if SCALE == 1 else 1_000
PACK_TOKENS = 8_192 // SCALE
LONGEST = 4_096 // SCALE


def long_tailed_lengths() -> np.ndarray:
    lengths = np.array([r["token_num"] for f in sorted(LENGTHS.glob("*.json")) for r in json.loads(f.read_text())])
    if not len(lengths):
        pytest.skip(f"needs the length files in {LENGTHS}")
    rng = np.random.default_rng(0)
    drawn = lengths[rng.permutation(len(lengths))[:SAMPLES]]
    long = rng.random(SAMPLES) < 0.15
    drawn[long] = np.exp(rng.uniform(np.log(2_048), np.log(4_096), int(long.sum())))
    return np.clip(drawn // SCALE, 8, LONGEST)


def planned_packs(lengths: np.ndarray, strategy: str) -> list[np.ndarray]:
    """The samples of each pack `packfeed plan` makes on one GPU, in step order."""
    from packfeed.server.plan.costs import SampleLoads
    from packfeed.server.plan.planner import make_plan
    from packfeed.v1.options import PlanConfig, Strategy

    n = len(lengths)
    loads = SampleLoads(np.ones(n, bool), np.zeros(n, np.int32), lengths.astype(np.int32), np.zeros(n, np.float32),
                        np.zeros(n, np.float32))
    plan = make_plan(loads, PlanConfig(dp=1, strategy=Strategy(strategy), token_cap=PACK_TOKENS, vision_cap=1), 0, 0)
    return [ids for ids in np.split(plan.members, plan.offsets[1:-1]) if len(ids)]


def model(attention: str):
    from packfeed.trainer.models.flavors import HF_FLAVORS
    from packfeed.trainer.models.hf.build import build_hf_model
    from packfeed.v1 import packfeed_pb2 as pb

    policy = pb.ImagePolicy(name="qwen2vl", patch_size=14, parameters_json='{"factor": 28}')
    conventions = pb.ModelConventions(image_policy=policy, vocab_size=VOCAB, image_context_id=VOCAB - 1)
    sizes = HF_FLAVORS["qwen2_vl"]["2b" if SCALE == 1 else "tiny"]
    built = build_hf_model("qwen2_vl", conventions, sizes, attention=attention)
    return built.to(DEVICE, torch.bfloat16 if DEVICE == "cuda" else torch.float32).train()


def batches(lengths: np.ndarray) -> dict[str, tuple[str, list[dict], int, int]]:
    """Per way: (attention, its microbatches' inputs on the device, real tokens, slots computed)."""
    from packfeed.client.model.hf import to_hf_inputs

    def on_device(inputs: dict) -> dict:
        return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}

    ways = {}
    for strategy in ("isf+balance", "random"):
        packs = [text_pack(lengths[ids].tolist(), seed=k, vocab=VOCAB)[0] for k, ids in
                 enumerate(planned_packs(lengths, strategy))]
        ways[f"{strategy} packs"] = ("varlen", [on_device(to_hf_inputs(p, "qwen2_vl", attention="varlen"))
                                                for p in packs], int(lengths.sum()), int(lengths.sum()))
    order = np.random.default_rng(1).permutation(len(lengths))
    groups = np.array_split(order, -(-len(lengths) // (PACK_TOKENS // LONGEST)))
    padded = [on_device(padded_inputs(text_pack(lengths[g].tolist(), seed=k, vocab=VOCAB)[1], DEVICE))
              for k, g in enumerate(groups)]
    ways["padded batches"] = ("sdpa", padded, int(lengths.sum()), int(sum(len(g) * lengths[g].max() for g in groups)))
    return ways


def epoch(net, microbatches: list[dict]) -> tuple[float, float]:
    """Seconds of forward + backward over every microbatch, and the peak memory in MiB."""
    cuda = DEVICE == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for inputs in microbatches:
        net(**inputs).loss.backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    net.zero_grad(set_to_none=True)
    return seconds, torch.cuda.max_memory_allocated() / 2 ** 20 if cuda else float("nan")


def test_an_epoch_as_padded_batches_random_packs_and_isf_balance_packs():
    from packfeed.client.model.hf import register_varlen_attention

    if DEVICE == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)
    lengths = long_tailed_lengths()
    ways = batches(lengths)
    nets = {"sdpa": model("sdpa"), "varlen": model(register_varlen_attention())}
    params = sum(p.numel() for p in nets["sdpa"].parameters()) / 1e9
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    print(f"\n[qwen2-vl epoch] {name}, torch {torch.__version__}; Qwen2-VL {'2b' if SCALE == 1 else 'tiny'} "
          f"({params:.2f} B parameters), {len(lengths)} samples of {lengths.min()}-{lengths.max()} tokens "
          f"(median {int(np.median(lengths))}, {int(lengths.sum()):,} in all)")
    for way, (attention, microbatches, _, _) in ways.items():  # warm-up: kernels chosen, memory pools grown
        epoch(nets[attention], microbatches[:3])
    runs: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
    for round_ in range(2):
        for way in ways if round_ == 0 else reversed(list(ways)):
            attention, microbatches, _, _ = ways[way]
            runs[way].append(epoch(nets[attention], microbatches))
            print(f"[qwen2-vl epoch] round {round_}: {way}: {runs[way][-1][0]:.2f} s", flush=True)
    print("[qwen2-vl epoch] way | microbatches | epoch s (median of 2; both) | tokens/s | padding | peak MiB | "
          "vs padded batches")
    base = statistics.median(s for s, _ in runs["padded batches"])
    for way, (_, microbatches, tokens, slots) in ways.items():
        median = statistics.median(s for s, _ in runs[way])
        print(f"[qwen2-vl epoch] {way} | {len(microbatches)} | {median:.2f} ({', '.join(f'{s:.2f}' for s, _ in runs[way])}) | "
              f"{tokens / median:,.0f} | {1 - tokens / slots:.1%} | {max(p for _, p in runs[way]):,.0f} | "
              f"{base / median:.2f}x")
    assert ways["padded batches"][3] > ways["isf+balance packs"][3]
    assert all(s > 0 for way in runs.values() for s, _ in way)
