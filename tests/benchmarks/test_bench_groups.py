"""A prompt and its images computed once (issue [4/6]): a GRPO-shaped mix planned and simulated with its groups'
prefixes shared, against the same samples each alone, in the same run.

Run: .venv/bin/python -m pytest -q -s tests/benchmarks/test_bench_groups.py -m benchmark

The mix: every prompt of the two InternVL-1.2M length files (30,730 real prompts: their tokens and image tiles)
answered G = 8 times, responses log-normal (median 600 tokens) clipped to 100-4,096: 245,840 samples, written as
a length file with `group` and `prefix_tokens`. `packfeed simulate --lengths FILE --json` (the command, as a user
runs it) plans it with isf+balance both ways (`shared_prefix` on, and off: each sample alone) and simulates both
on the internvl-chat-1.5 preset (PP 4, M 8) at DP 8 and DP 64. Reported per DP: LLM tokens, vision units, steps,
the simulated step and epoch time shared vs alone, groups split over packs; median and range of 3 rounds
(different response draws). Then the reference trainer's step on CPU on both layouts, and `packfeed train --nproc
2` for an epoch of a grouped dataset converted and indexed from annotations, shared and not (their docstrings).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import numpy as np
import pytest
from conftest import real_lengths_available
from test_bench_phases import internvl_lengths

pytestmark = pytest.mark.benchmark
ROUNDS = 3
G = 8


def grpo_records(seed: int) -> list[dict]:
    """Every real prompt answered G times: the prompt is the record's tokens and tiles, the responses drawn."""
    rng = np.random.default_rng(seed)
    vision, tokens = internvl_lengths()
    responses = np.clip(rng.lognormal(np.log(600), 1.0, (len(vision), G)), 100, 4096).astype(np.int64)
    return [{"vit_num": int(v), "token_num": int(t + r), "group": k, "prefix_tokens": int(t)}
            for k, (v, t) in enumerate(zip(vision.tolist(), tokens.tolist())) for r in responses[k].tolist()]


def simulate(path, dp: int) -> dict:
    run = subprocess.run([sys.executable, "-m", "packfeed.cli", "simulate", "--lengths", str(path), "--dp",
                          str(dp), "--microbatches", "8", "--json"], capture_output=True, text=True, check=True)
    return json.loads(run.stdout)


@pytest.mark.skipif(not real_lengths_available(), reason="the real InternVL length files are not here")
def test_shared_prefixes_on_a_grpo_shaped_mix(tmp_path):
    results: dict[int, list[dict]] = {8: [], 64: []}
    for round_ in range(ROUNDS):
        path = tmp_path / f"grpo-{round_}.json"
        path.write_text(json.dumps(grpo_records(round_)))
        for dp in results:
            record = simulate(path, dp)
            results[dp].append(record["groups"])
    print()
    for dp, rounds in results.items():
        def stat(name, scale=1.0):
            values = [r[name] / scale for r in rounds]
            return f"{statistics.median(values):,.3f} ({min(values):,.3f}-{max(values):,.3f})"

        print(f"DP {dp}, M 8, PP 4, internvl-chat-1.5, {rounds[0]['groups']:,} groups of {G}:")
        for label in ("shared", "unshared"):
            print(f"  {label:>8}: LLM tokens {stat(f'llm_tokens_{label}', 1e6)} M, vision units "
                  f"{stat(f'vision_units_{label}', 1e3)} k, steps {stat(f'steps_{label}')}, step "
                  f"{stat(f'step_s_{label}')} s, epoch {stat(f'epoch_s_{label}')} s")
        print(f"  epoch speedup {stat('epoch_speedup')}x; groups over more than one pack {stat('split_groups')}; "
              f"prefix tokens saved {stat('prefix_tokens_saved', 1e6)} M")
        for r in rounds:  # the shared plan computes what the unshared one does, less each repeated prefix
            assert r["llm_tokens_unshared"] - r["llm_tokens_shared"] == r["prefix_tokens_saved"]
            assert r["epoch_s_shared"] < r["epoch_s_unshared"]


# -- the trainer's step on CPU ------------------------------------------------------------------------------------

TILE, TOKENS_PER_TILE, CONTEXT = 448, 256, 3  # InternVL's tiles: 448 px, 256 placeholder tokens each
CPU_MODEL = {"vit_dim": 48, "vit_layers": 3, "llm_dim": 96, "llm_layers": 3, "patch_size": 14, "seed": 0}
STEPS = 6


def group_pack(rng, vision: int, prompt_text: int, g: int):
    """The wire pack of one prompt with `vision` tiles and `prompt_text` more tokens, answered g times (responses
    log-normal, median 600, 100-4,096 tokens), as a server sends it: the prompt's tiles once, siblings naming it."""
    import torch

    from packfeed.client.stream.tensors import PackTensors

    prompt = np.r_[rng.integers(10, 500, 4), np.full(vision * TOKENS_PER_TILE, CONTEXT), rng.integers(10, 500, prompt_text)]
    responses = np.clip(rng.lognormal(np.log(600), 1.0, g), 100, 4096).astype(int)
    ids = [np.r_[prompt, rng.integers(10, 500, r)] for r in responses]
    labels = [np.r_[np.full(len(prompt), -100), x[len(prompt):]] for x in ids]
    bounds = np.r_[0, np.cumsum([len(x) for x in ids])]
    tensors = {"input_ids": torch.tensor(np.concatenate(ids), dtype=torch.int32),
               "labels": torch.tensor(np.concatenate(labels), dtype=torch.int32),
               "position_ids": torch.tensor(np.concatenate([np.arange(len(x)) for x in ids]), dtype=torch.int32),
               "cu_seqlens": torch.tensor(bounds, dtype=torch.int32),
               "pixels": torch.randint(0, 255, (vision * 3 * TILE * TILE,), dtype=torch.uint8),
               "tile_shapes": torch.tensor([[3, TILE, TILE]] * vision, dtype=torch.int32).view(-1, 3),
               "tile_image": torch.zeros(vision, dtype=torch.int32),
               "image_sample": torch.zeros(1 if vision else 0, dtype=torch.int32),
               "image_token_spans": torch.tensor([[4, vision * TOKENS_PER_TILE]] if vision else [],
                                                 dtype=torch.int32).view(-1, 2),
               "shared_prefix": torch.tensor([[0, len(prompt)]] * g, dtype=torch.int32)}
    loss = int(sum((x != -100).sum() for x in labels))
    return PackTensors(0, 0, 0, 0, False, [f"r{k}" for k in range(g)], loss, loss, [], tensors)


def step_seconds(layers, config, pack) -> float:
    import time
    from types import SimpleNamespace

    from packfeed.trainer.models.reference import run_layers
    from packfeed.trainer.models.reference_inputs import microbatches_of

    started = time.perf_counter()
    step = SimpleNamespace(packs=[pack], epoch=0, step=0, last_in_epoch=False, sample_sources=[])
    args = microbatches_of(step, config).args
    layers.zero_grad(set_to_none=True)
    run_layers(layers, args)[0].backward()
    return time.perf_counter() - started


@pytest.mark.skipif(not real_lengths_available(), reason="the real InternVL length files are not here")
def test_the_trainers_step_on_cpu_shared_vs_each_response_alone():
    """The reference trainer's step (its inputs, `microbatches_of`, and its model, forward and backward, as
    `packfeed train` runs a microbatch at pp 1; the train benchmark's small model) on packs of one real prompt (a
    record's tiles, capped at 4, and its text) answered G = 8 times: laid out with the prompt once, and each response after its own copy
    (`unshared`), alternating, on the same packs. Median and range of per-step seconds over 3 rounds."""
    import torch

    from packfeed.client.model.shared_prefix import unshared
    from packfeed.trainer.models.reference import VLMConfig, build_layers

    torch.manual_seed(0)
    config = VLMConfig(vocab_size=512, tile_size=TILE, tokens_per_tile=TOKENS_PER_TILE, **CPU_MODEL)
    layers = build_layers(config)
    vision, tokens = internvl_lengths()
    rng = np.random.default_rng(0)
    chosen = rng.choice(len(vision), STEPS, replace=False)
    packs = [group_pack(rng, min(int(vision[k]), 4), max(16, int(tokens[k]) - 256 * int(vision[k])), G)
             for k in chosen]
    step_seconds(layers, config, packs[0])  # warm up
    rounds = {"shared": [], "unshared": []}
    for _ in range(ROUNDS):
        for label in rounds:
            seconds = [step_seconds(layers, config, pack if label == "shared" else unshared(pack)) for pack in packs]
            rounds[label].append(sum(seconds) / len(seconds))
    shared_tokens = sum(int(p.input_ids.numel()) - (G - 1) * (int(p.shared_prefix[0, 1]) - 1) for p in packs) / STEPS
    alone_tokens = sum(int(p.input_ids.numel()) for p in packs) / STEPS
    print(f"\nreference trainer step on CPU ({torch.get_num_threads()} threads), G = {G}, {STEPS} packs:")
    for label, tokens_per_step, tiles in (("shared", shared_tokens, 1), ("unshared", alone_tokens, G)):
        values = rounds[label]
        print(f"  {label:>8}: {statistics.median(values) * 1e3:,.0f} ms a step ({min(values) * 1e3:,.0f}-"
              f"{max(values) * 1e3:,.0f}), {tokens_per_step:,.0f} LLM tokens, prompt tiles x {tiles}")
    speedup = [a / s for a, s in zip(rounds["unshared"], rounds["shared"])]
    print(f"  speedup {statistics.median(speedup):.2f}x ({min(speedup):.2f}-{max(speedup):.2f})")
    assert statistics.median(rounds["shared"]) < statistics.median(rounds["unshared"])


# -- packfeed train on a grouped dataset --------------------------------------------------------------------------

TRAIN_POLICY = {"name": "internvl", "image_size": 224, "tokens_per_tile": 64, "max_num": 6}  # the train benchmark's
TRAIN_MODEL = {"vit_dim": 48, "vit_layers": 3, "llm_dim": 96, "llm_layers": 3, "patch_size": 14, "seed": 0}
PROMPTS = 24


def grouped_rows(root, seed: int = 0) -> list[dict]:
    """PROMPTS prompts, each with 1-3 photographs-like images and a question of 20-200 words, answered G times
    with 20-400 words (log-normal): GRPO's rollouts kept as a dataset."""
    from recipe_data import write_image

    rng = np.random.default_rng(seed)
    words = ["the", "chart", "shows", "a", "rise", "in", "sales", "after", "march", "while", "costs", "fall"]
    rows = []
    for p in range(PROMPTS):
        names = [f"p{p}-{k}.jpg" for k in range(int(rng.integers(1, 4)))]
        for name in names:
            write_image(root / "images" / name, rng)
        question = "<image>\n" * len(names) + " ".join(rng.choice(words, int(rng.integers(20, 200))))
        for k in range(G):
            answer = " ".join(rng.choice(words, int(np.clip(rng.lognormal(np.log(120), 0.8), 20, 400))))
            rows.append({"id": f"p{p}-{k}", "group": p, "images": names,
                         "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]})
    return rows


def train_run(index, out, shared: bool, bounds: list[int] | None) -> tuple[list[dict], list[int]]:
    from trainer_workers import packfeed_train

    partition = [f"partition.bounds=[{','.join(map(str, bounds))}]"] if bounds else \
        ["partition.top_k=2", "partition.trial_steps=1"]
    overrides = [f"data.index={index}", "data.microbatches=4", f"data.job=groups-{shared}", "data.server_workers=1",
                 "data.prefetch=4", f"data.shared_prefix={'true' if shared else 'false'}", "parallel.pp=2",
                 "recompute.mode=none", "optim.steps=0", *partition] + [f"model.{k}={v}" for k, v in TRAIN_MODEL.items()]
    _, records = packfeed_train(2, overrides, out, timeout=1800)
    used = bounds or json.loads((out / "partition.json").read_text())["bounds"]
    return records, used


def test_packfeed_train_on_a_grouped_dataset_shared_vs_each_response_alone(tmp_path):
    """`packfeed train --nproc 2` (2 pipeline stages, gloo, M 4, the train benchmark's model) for one epoch of a
    grouped dataset, its prompts' prefixes shared (the default) and each response alone (`data.shared_prefix=false`),
    on the partition the first run searched; epoch time (the sum of step times), steps, LLM tokens computed and
    samples a second, 3 rounds alternating."""
    from group_data import index_annotations

    index = index_annotations(tmp_path / "data", grouped_rows(tmp_path / "data"), TRAIN_POLICY)
    _, bounds = train_run(index, tmp_path / "search", True, None)
    runs = {True: [], False: []}
    for round_ in range(ROUNDS):
        for shared in (True, False) if round_ % 2 == 0 else (False, True):
            records, _ = train_run(index, tmp_path / f"r{round_}-{shared}", shared, bounds)
            runs[shared].append({"epoch_s": sum(r["step_s"] for r in records), "steps": len(records),
                                 "tokens": sum(r["tokens"] for r in records)})
    print(f"\npackfeed train --nproc 2 (pp 2, M 4), {PROMPTS} prompts x {G} responses, partition {bounds}:")
    for shared, label in ((True, "prefixes shared"), (False, "each response alone")):
        epochs = [r["epoch_s"] for r in runs[shared]]
        rates = [PROMPTS * G / r["epoch_s"] for r in runs[shared]]
        print(f"  {label:>20}: epoch {statistics.median(epochs):.1f} s ({min(epochs):.1f}-{max(epochs):.1f}), "
              f"{runs[shared][0]['steps']} steps, {runs[shared][0]['tokens']:,} tokens, "
              f"{statistics.median(rates):.1f} samples/s ({min(rates):.1f}-{max(rates):.1f})")
    speedup = [a["epoch_s"] / s["epoch_s"] for a, s in zip(runs[False], runs[True])]
    print(f"  epoch speedup {statistics.median(speedup):.2f}x ({min(speedup):.2f}-{max(speedup):.2f})")
    assert runs[True][0]["tokens"] < runs[False][0]["tokens"]
