"""`packfeed simulate --context-parallel C`: the CP step model on hand-computed cases (a pack's GPUs start it
together, each does 1/d of it, the exchange adds or overlaps), and the command on the long-video mix: both modes,
no GPU over N, dynamic balances better than static."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from long_video_mix import write_long_video_mix

from packfeed.trainer.simulate.cluster import Cluster
from packfeed.trainer.simulate.context_parallel import CpWorkload, simulate_cp
from packfeed.trainer.simulate.model_shape import TILES, TOKEN_SQUARE, TOKENS, LayerTable


def llm_table(per_token: float, per_square: float, kv_bytes: float = 0.0) -> LayerTable:
    """One LLM layer of given forward seconds per token and per squared token (backward twice), no parameters."""
    seconds = np.zeros((1, 2, 5))
    seconds[0, :, TOKENS] = per_token, 2 * per_token
    seconds[0, :, TOKEN_SQUARE] = per_square, 2 * per_square
    out = np.zeros((1, 5))
    out[0, TOKENS] = kv_bytes / 2
    return LayerTable("test", ["llm"], None, seconds, np.zeros(1), out, "measured")


def workload(packs: list[tuple[int, int, int, int, float]], c: int, microbatches: int = 1) -> CpWorkload:
    """packs: (microbatch, replica, degree, cp_group, tokens), one step."""
    loads = np.zeros((len(packs), 5))
    loads[:, 0] = 1
    loads[:, TOKENS] = [p[4] for p in packs]
    loads[:, TOKEN_SQUARE] = loads[:, TOKENS] ** 2  # one sample per pack
    arrays = [np.array([p[k] for p in packs], dtype=np.int64) for k in range(4)]
    return CpWorkload(np.zeros(len(packs), np.int64), arrays[1], arrays[0], arrays[2], arrays[3], loads, 1, 1,
                      microbatches, c, len(packs), "dynamic")


def test_a_pack_split_over_d_gpus_takes_a_dth_of_the_time_and_they_start_together():
    table = llm_table(per_token=1.0, per_square=0.0)
    cluster = Cluster(4, latency_s=0.0)
    # microbatch 0: lane 0 carries 8 tokens alone, lane 1 carries 2; microbatch 1: one pack of 8 on lanes 0-1
    got = simulate_cp(workload([(0, 0, 1, 0, 8), (0, 0, 1, 1, 2), (1, 0, 2, 0, 8), (1, 0, 2, 1, 4)], 4, 2),
                      table, cluster)
    # lane 0: 8 x 3 s (forward + backward) = 24, then the shared pack 8 / 2 x 3 = 12 -> 36; lanes 2-3: 4/2 x 3 = 6
    assert got["step_s"] == pytest.approx(36.0)
    busy = 24 + 6 + 2 * 12 + 2 * 6
    assert got["bubble_fraction"] == pytest.approx(1 - busy / (4 * 36.0))
    assert got["peak_tokens_per_gpu"] == 8


def test_megatron_llava_runs_the_vision_tower_unsplit_on_every_gpu_of_a_pack():
    seconds = np.zeros((2, 2, 5))
    seconds[0, :, TILES] = 1.0, 2.0  # a vision layer: 1 s a tile forward, 2 backward
    seconds[1, :, TOKENS] = 0.01, 0.02
    out = np.zeros((2, 5))
    table = LayerTable("test", ["vision", "llm"], None, seconds, np.zeros(2), out, "measured")
    packs = workload([(0, 0, 4, 0, 400)], 4)
    packs.loads[:, TILES] = 8
    split = simulate_cp(packs, table, Cluster(4, latency_s=0.0))
    packs.mode = "megatron-llava"
    whole = simulate_cp(packs, table, Cluster(4, latency_s=0.0))
    # tokens: 400 / 4 x 0.03 = 3 s on each GPU; tiles: 8 / 4 x 3 = 6 s shared, 8 x 3 = 24 s on every GPU
    assert split["step_s"] == pytest.approx(3 + 6) and whole["step_s"] == pytest.approx(3 + 24)


def test_the_exchange_adds_to_attention_or_overlaps_it():
    table = llm_table(per_token=0.0, per_square=1e-3, kv_bytes=1e9)
    cluster = Cluster(2, intra_gbs=1.0, latency_s=0.0)
    packs = workload([(0, 0, 2, 0, 100)], 2)
    # attention: 100^2 x 1e-3 / 2 = 5 s forward, 10 backward; exchange: 1/2 x 100 x 1e9 B at 1 GB/s = 50 s each way
    assert simulate_cp(packs, table, cluster, "allgather")["step_s"] == pytest.approx(5 + 10 + 2 * 50)
    assert simulate_cp(packs, table, cluster, "ring")["step_s"] == pytest.approx(2 * 50)
    with pytest.raises(ValueError, match="--cp-comm"):
        simulate_cp(packs, table, cluster, "carrier pigeon")


def test_the_kv_exchange_counts_the_kv_heads_not_the_hidden_size():
    """Under grouped-query attention a layer's K and V are its K/V heads x head size, not its hidden size:
    InternVL-Chat-1.5's LLM (48 heads, 8 K/V heads of 128) exchanges 2 x 8 x 128 x 2 bytes a token, a sixth of
    2 x its hidden size; the pack's exchange seconds shrink by as much. A measured cost model (no heads known)
    keeps the upper bound."""
    from dataclasses import replace

    from packfeed.trainer.simulate.context_parallel import pack_seconds
    from packfeed.trainer.simulate.model_shape import internvl_chat_1_5

    shape = internvl_chat_1_5()
    gqa = shape.layer_table()
    llm = np.array([kind == "llm" for kind in gqa.kinds])
    assert set(gqa.kv_bytes_per_token()[llm]) == {2 * 8 * 128 * 2}
    assert (gqa.kv_bytes_per_token()[llm] * 6 == 2 * gqa.output_bytes[llm, TOKENS]).all()
    full = replace(shape, llm=replace(shape.llm, kv_heads=0)).layer_table()  # every head its own K and V
    assert set(full.kv_bytes_per_token()[llm]) == {2 * 48 * 128 * 2}
    cluster = Cluster(2, intra_gbs=1.0, latency_s=0.0, peak_tflops=1e18)  # compute ~free: the exchange counts
    loads = np.zeros((1, 5))
    loads[0, 0], loads[0, TOKENS] = 1, 1000
    seconds = [pack_seconds(t, cluster, loads, np.array([2]), [[0, 1]])[0] for t in (gqa, full)]
    assert seconds[1] == pytest.approx(6 * seconds[0], rel=1e-6)
    assert llm_table(1.0, 0.0, kv_bytes=100.0).kv_bytes is None  # measured: 2 x the output bytes


def simulate(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "packfeed.cli", "simulate", *args, "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return {r["mode"]: r for r in json.loads(done.stdout)["context_parallel"]}


def test_the_command_on_the_long_video_mix(tmp_path):
    mix = write_long_video_mix(tmp_path / "mix.json", short=3000)
    args = ["--lengths", str(mix), "--dp", "4", "--context-parallel", "4", "--max-tokens-per-gpu", "32768",
            "--microbatches", "1"]
    got = simulate(*args)
    assert set(got) == {"dynamic", "static", "megatron-llava"}
    for record in got.values():
        assert record["peak_tokens_per_gpu"] <= 32768 and record["oversize"] == 0 and record["gpus"] == 16
        assert record["samples"] == 3000 + round(3000 * 0.05 / 0.95)
    assert set(got["dynamic"]["degrees"]) == {"1", "2", "4"} and set(got["static"]["degrees"]) == {"4"}
    # Megatron-Core's LLaVA: the same static packs, every GPU running the vision tower over all their images
    assert got["megatron-llava"]["degrees"] == got["static"]["degrees"]
    assert got["megatron-llava"]["epoch_s"] > got["static"]["epoch_s"]
    # the bound no plan beats: below every mode's epoch, its sync over the fewest steps that hold every token at
    # N per GPU and M microbatches a step
    tokens = sum(row["token_num"] for row in json.loads(mix.read_text()))
    for record in got.values():
        assert 0 < record["bound_epoch_s"] <= record["epoch_s"] and record["above_bound"] >= 0
        assert record["bound_steps"] == -(-tokens // (16 * 32768))
    at_m4 = simulate(*args[:-1], "4")["dynamic"]
    assert at_m4["bound_steps"] == -(-tokens // (16 * 32768 * 4)) < got["dynamic"]["bound_steps"]
    assert got["dynamic"]["bubble_fraction"] < got["static"]["bubble_fraction"]
    assert got["dynamic"]["epoch_s"] < got["static"]["epoch_s"]
    def timeless(records):
        return {mode: {k: v for k, v in r.items() if k != "planning_s"} for mode, r in records.items()}

    assert timeless(simulate(*args)) == timeless(got), "not deterministic"
    ring = simulate(*args, "--cp-comm", "ring", "--cp-mode", "static")
    assert set(ring) == {"static"} and ring["static"]["epoch_s"] <= got["static"]["epoch_s"]


def test_without_a_per_gpu_budget_plan_and_simulate_say_how_many_samples_exceed_the_default(tmp_path):
    """No --max-tokens-per-gpu: N is the token cap, and the long samples above it are named with the flag (not
    only an oversize count); with the flag given, no note."""
    mix = write_long_video_mix(tmp_path / "mix.json", short=300)
    common = ["--lengths", str(mix), "--dp", "2", "--context-parallel", "4", "--microbatches", "1", "--json"]
    done = subprocess.run([sys.executable, "-m", "packfeed.cli", "simulate", *common], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    n = json.loads(done.stdout)["context_parallel"][0]["max_tokens_per_gpu"]
    tokens = [row["token_num"] for row in json.loads(mix.read_text())]
    note = next(line for line in done.stderr.splitlines() if line.startswith("note: no --max-tokens-per-gpu"))
    assert f"N = {n:,} tokens" in note and f"{sum(t > n for t in tokens):,} samples hold more" in note
    given = subprocess.run([sys.executable, "-m", "packfeed.cli", "simulate", *common,
                            "--max-tokens-per-gpu", "32768"], capture_output=True, text=True, timeout=300)
    assert given.returncode == 0 and "no --max-tokens-per-gpu" not in given.stderr


def test_the_command_refuses_what_it_cannot_simulate(tmp_path):
    mix = write_long_video_mix(tmp_path / "mix.json", short=200)
    for extra, message in ((["--context-parallel", "4", "--pp", "2"], "pp 1"),
                           (["--context-parallel", "4", "--strategy", "random"], "plans ISF packs"),
                           (["--cp-mode", "static"], "apply with --context-parallel")):
        done = subprocess.run([sys.executable, "-m", "packfeed.cli", "simulate", "--lengths", str(mix),
                               *extra], capture_output=True, text=True, timeout=300)
        assert done.returncode != 0 and message in done.stderr


def test_a_cp_plan_file_is_simulated_as_the_cp_plan_it_is(tmp_path):
    """`simulate --plan` of a file `packfeed plan --context-parallel` wrote, with no CP flag given: its own mode,
    dp, microbatches and C, its packs' degrees as planned; a --cp-mode it was not planned in is refused."""
    mix = write_long_video_mix(tmp_path / "mix.json", short=300)
    cli = [sys.executable, "-m", "packfeed.cli"]
    index = tmp_path / "index"
    done = subprocess.run(cli + ["index", "--from-lengths", str(mix), "--out", str(index)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for mode in ("dynamic", "static"):
        planned = subprocess.run(cli + ["plan", "--index", str(index), "--dp", "2", "--microbatches", "2",
                                        "--context-parallel", "4", "--max-tokens-per-gpu", "32768", "--cp-mode",
                                        mode, "--out", str(tmp_path / f"{mode}.parquet")],
                                 capture_output=True, text=True, timeout=300)
        assert planned.returncode == 0, planned.stderr
        degrees = json.loads(planned.stdout.strip().splitlines()[-1])["context_parallel"]["degrees"]
        got = simulate("--plan", str(tmp_path / f"{mode}.parquet"), "--index", str(index))
        assert set(got) == {mode} and got[mode]["gpus"] == 8 and got[mode]["degrees"] == degrees
        assert got[mode]["peak_tokens_per_gpu"] <= 32768
    assert set(simulate("--plan", str(tmp_path / "static.parquet"), "--index", str(index), "--cp-mode",
                        "megatron-llava")) == {"megatron-llava"}
    refused = subprocess.run(cli + ["simulate", "--plan", str(tmp_path / "static.parquet"), "--index", str(index),
                                    "--cp-mode", "dynamic"], capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "is a static CP plan" in refused.stderr


def test_the_split_spans_are_the_contracts_zigzag_chunks():
    from packfeed.trainer.simulate.split_attention import zigzag_spans
    from packfeed.v1.context_parallel import pack_shares, rank_chunks

    rng = np.random.default_rng(0)
    for _ in range(200):
        degree = int(rng.choice([1, 2, 4, 8]))
        lengths = rng.integers(0, 70, size=int(rng.integers(1, 6)))
        starts, stops, used = zigzag_spans(lengths, degree)
        for sample, chunks in enumerate(pack_shares(lengths.tolist(), degree)):
            for rank in range(degree):
                (a1, b1), (a2, b2) = rank_chunks(chunks, rank)
                runs = [s for s in ([(a1, b2)] if b1 == a2 else [(a1, b1), (a2, b2)]) if s[1] > s[0]]
                got = [(int(starts[sample, rank, k]), int(stops[sample, rank, k])) for k in range(2)
                       if used[sample, rank, k]]
                assert got == runs, (lengths, degree, sample, rank)


def test_split_attention_costs_tiles_and_gathered_rows():
    """Tiles cover at least the causal area and nearly equal it for a long sample; short samples cut into 2d
    chunks cost more tiles per GPU the higher d; K/V rows are gathered only when split."""
    from packfeed.trainer.simulate.split_attention import share_costs, tile_elements

    starts, stops = np.array([0, 100, 3]), np.array([300, 101, 40])
    exact = np.array([(b * (b + 1) - a * (a + 1)) / 2 for a, b in zip(starts, stops)])
    assert np.array_equal(tile_elements(starts, stops, (1, 1)), exact)
    assert np.all(tile_elements(starts, stops, (128, 64)) >= exact)
    long_whole, rows = share_costs(np.array([131_072]), 1)
    assert rows == 0 and 1.0 < long_whole / 131_072 ** 2 < 1.01
    short = np.full(64, 500)
    per_token = [share_costs(short, d)[0] / (short.astype(float) ** 2).sum() * d for d in (1, 2, 4, 8)]
    assert per_token == sorted(per_token) and per_token[-1] > 2 * per_token[0]
    _, rows = share_costs(short, 4)
    assert rows >= short.sum()  # every GPU's rows, and the keys its chunks see


def test_plans_charge_the_split_and_the_gathered_rows():
    """The same packs cost more with their sample lengths known (tiles, gathered K/V) than by FLOPs alone;
    the gathered rows only under the all-gather."""
    table, cluster = llm_table(1e-6, 1e-9, kv_bytes=4096.0), Cluster(gpus=4)
    lengths = [np.full(16, 400)] * 4
    base = dict(step=np.zeros(4), replica=[0, 0, 0, 0], microbatch=[0, 1, 2, 3], degree=[4] * 4, group=[0] * 4,
                tokens=[6400.0] * 4, tiles=[0.0] * 4, square=[16 * 400.0 ** 2] * 4, patches_per_tile=1, steps=1,
                dp=1, microbatches=4, groups=4, samples=64, mode="static")
    flops_only, measured = CpWorkload.of_packs(**base), CpWorkload.of_packs(**base, lengths=lengths)
    step = {comm: [simulate_cp(w, table, cluster, comm)["step_s"] for w in (flops_only, measured)]
            for comm in ("allgather", "ring")}
    assert step["ring"][1] > step["ring"][0] and step["allgather"][1] - step["allgather"][0] > \
        step["ring"][1] - step["ring"][0]
