"""What collective-safe plans cost (issue [5/6]): the same epoch planned with `collective_safe` on (the default)
and off, in the same run.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_collective.py -m benchmark

`packfeed plan --index INDEX --dp D --microbatches 4 --strategy S [--no-collective-safe]` run as a command
(isf+balance, and isf: OmniBal's packs in random order), on:
- the two InternVL-1.2M length files (30,730 samples; every sample has an image, as InternVL gives text-only
  samples a dummy tile): nothing to align, so the guarantee should cost nothing;
- the incoherent mix (`test_bench_phases.incoherent_mix`: the same files plus a quarter of text-only
  conversations and 5% many-tile documents): the text-only samples a Qwen-style model calls no tower for;
- a mostly-text mix: 80% text only, 15% of the files' image samples, 5% videos (a video tower's calls).
At DP 8 and DP 64, M 4: ViT and LLM Dist, packs, the microbatches that call a tower on some ranks only, and the
planning time the command reports (median and spread of 5 rounds, on and off alternating).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import numpy as np
import pytest
from conftest import real_lengths_available
from test_bench_phases import incoherent_mix, internvl_lengths

pytestmark = pytest.mark.benchmark
ROUNDS = 5


def mostly_text_mix(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(vision units, tokens, tower bits): 80% text only, 15% image samples of the files, 5% videos."""
    rng = np.random.default_rng(seed)
    vision, tokens = internvl_lengths()
    n = len(vision)
    kind = rng.choice(3, n, p=[0.8, 0.15, 0.05])
    text = np.clip(rng.lognormal(np.log(350), 1.0, n), 16, 8192).astype(np.int64)
    frames = rng.integers(8, 33, n)  # a video's sampled frames, a unit each
    vision = np.select([kind == 0, kind == 1], [0, vision], frames)
    tokens = np.select([kind == 0, kind == 1], [text, tokens], 64 * frames + text)
    return vision, tokens, np.array([0, 1, 2], dtype=np.uint8)[kind]


def write_index(path, vision, tokens, towers=None):
    """An index of bare lengths; `towers` written as the media counts the planner reads them from."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from packfeed.server.index.lengths import write_lengths_index

    write_lengths_index(vision, tokens, vision, path, ["bench"], np.zeros(len(vision), np.int32))
    if towers is not None:
        table = pq.read_table(path)
        metadata = table.schema.metadata
        for name, bit in (("n_images", 1), ("n_videos", 2)):
            column = pa.array(((towers & bit) > 0).astype(np.int32))
            at = table.schema.get_field_index(name)
            table = table.set_column(at, name, column) if at >= 0 else table.append_column(name, column)
        pq.write_table(table.replace_schema_metadata(metadata), path)
    return path


def plan(index, dp: int, safe: bool, strategy: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "packfeed.cli", "plan", "--index", str(index), "--dp", str(dp),
                          "--microbatches", "4", "--strategy", strategy, *([] if safe else ["--no-collective-safe"])],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not real_lengths_available(), reason="needs ../shared/data/lengths")
def test_the_cost_of_collective_safe_plans(tmp_path):
    from packfeed.server.plan.costs import load_sample_loads

    datasets = {"internvl": write_index(tmp_path / "internvl.parquet", *internvl_lengths()),
                "incoherent": write_index(tmp_path / "incoherent.parquet", *incoherent_mix()),
                "mostly text": write_index(tmp_path / "text.parquet", *mostly_text_mix())}
    text_only = {name: float(np.mean(load_sample_loads(index)[0].towers == 0)) for name, index in datasets.items()}
    print("\n[collective] dataset | strategy | DP | collective_safe | packs | ViT Dist | LLM Dist | unaligned microbatches | "
          f"planning s (median, min-max of {ROUNDS})")
    for name, index, strategy, dp in [(name, index, strategy, dp) for name, index in datasets.items()
                                      for strategy in ("isf+balance", "isf") for dp in (8, 64)]:
            runs = {True: [], False: []}
            for _ in range(ROUNDS):
                for safe in (True, False):
                    runs[safe].append(plan(index, dp, safe, strategy))
            for safe in (True, False):
                first, seconds = runs[safe][0], [r["planning_seconds"] for r in runs[safe]]
                alignment = first["collective_safe"]
                print(f"[collective] {name} ({text_only[name]:.0%} text only) | {strategy} | {dp} | {'on' if safe else 'off'} | "
                      f"{first['packs']} | {first['vit_dist']:.4f} | {first['llm_dist']:.4f} | "
                      f"{alignment['unaligned_microbatches']} / {alignment['microbatches']} "
                      f"{alignment['unaligned_by_tower']} | {statistics.median(seconds):.3f} "
                      f"({min(seconds):.3f}-{max(seconds):.3f})")
                assert all(r["plan_fingerprint"] == first["plan_fingerprint"] for r in runs[safe])  # deterministic
            on, off = runs[True][0]["collective_safe"], runs[False][0]["collective_safe"]
            # what stays unaligned is the last step's (M microbatches) and one column per class at most
            assert on["unaligned_microbatches"] <= 4 + 3


def cp_plan(index, safe: bool, max_tokens: int) -> dict:
    """The issue's command: `packfeed plan --dp 8 --microbatches 4 --context-parallel 4 --max-tokens-per-gpu N`."""
    out = subprocess.run([sys.executable, "-m", "packfeed.cli", "plan", "--index", str(index), "--dp", "8",
                          "--microbatches", "4", "--context-parallel", "4", "--max-tokens-per-gpu", str(max_tokens),
                          *([] if safe else ["--no-collective-safe"])], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(not real_lengths_available(), reason="needs ../shared/data/lengths")
def test_the_cost_of_collective_safe_dynamic_context_parallel_plans(tmp_path):
    """Dynamic CP (DP 8 x C 4 = 32 GPUs, M 4), collective-safe over every GPU or not, on the mostly-text mix and
    the incoherent mix: at N = 40,960 (the issue's command) and at N = 4,096, where long samples span 2 and 4
    GPUs. GPU Dist: over all 32 GPUs' work per step (the CP summary's)."""
    datasets = {"mostly text": write_index(tmp_path / "text.parquet", *mostly_text_mix()),
                "incoherent": write_index(tmp_path / "incoherent.parquet", *incoherent_mix())}
    print("\n[collective-cp] dataset | N | collective_safe | steps | GPU Dist | degrees | unaligned microbatches | "
          f"planning s (median, min-max of {ROUNDS})")
    for name, index in datasets.items():
        for max_tokens in (40960, 4096):
            runs = {True: [], False: []}
            for _ in range(ROUNDS):
                for safe in (True, False):
                    runs[safe].append(cp_plan(index, safe, max_tokens))
            for safe in (True, False):
                first, seconds = runs[safe][0], [r["planning_seconds"] for r in runs[safe]]
                cp, alignment = first["context_parallel"], first["collective_safe"]
                print(f"[collective-cp] {name} | {max_tokens} | {'on' if safe else 'off'} | {first['steps']} | "
                      f"{cp['gpu_dist']:.4f} | {cp['degrees']} | {alignment['unaligned_microbatches']} / "
                      f"{alignment['microbatches']} | {statistics.median(seconds):.3f} "
                      f"({min(seconds):.3f}-{max(seconds):.3f})")
                assert all(r["plan_fingerprint"] == first["plan_fingerprint"] for r in runs[safe])
            assert runs[True][0]["collective_safe"]["on"]
            assert runs[True][0]["collective_safe"]["unaligned_microbatches"] <= 3  # a partial column a class
