"""The cluster simulator (`packfeed simulate`): schedules respect every dependency, hand-computed cases, the
encoder placements against each other, the disaggregated split search against an exhaustive sweep, and the
command on length files, index/plan files and a trainer's measured costs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from packfeed.server.plan.costs import SampleLoads
from packfeed.trainer.simulate.cluster import Cluster
from packfeed.trainer.simulate.model_shape import (
    PRESETS,
    TILES,
    TOKENS,
    LayerTable,
    Transformer,
    load_model,
)
from packfeed.trainer.parallel.schedules import encoder_deadlines, pipeline_order, split_tiles
from packfeed.trainer.simulate.placement import Placement, simulate_step, step_costs
from packfeed.trainer.simulate.predict import Settings, search_allocation, simulate_plan
from packfeed.cli.simulate_data import make_workload
from packfeed.trainer.simulate.workload import planner_cost_model

LENGTHS = Path(__file__).resolve().parents[2] / "shared" / "data" / "lengths"


def table_of(encoder: list[tuple[float, float]], llm: list[tuple[float, float]], out_bytes: float = 0.0,
             per: int = TILES) -> LayerTable:
    """Layers with given (forward, backward) seconds per tile (encoder) and per token (LLM)."""
    rows = [("vision", f, b, TILES) for f, b in encoder] + [("llm", f, b, TOKENS) for f, b in llm]
    seconds = np.zeros((len(rows), 2, 5))
    out = np.zeros((len(rows), 5))
    for i, (_, f, b, unit) in enumerate(rows):
        seconds[i, :, unit] = f, b
        out[i, unit] = out_bytes
    return LayerTable("test", [r[0] for r in rows], None, seconds, np.ones(len(rows)), out, "measured")


def loads_of(rows: list[list[tuple[int, int]]]) -> np.ndarray:
    """(replicas, microbatches, terms) from (tiles, tokens) per microbatch."""
    out = np.zeros((len(rows), len(rows[0]), 5))
    for r, replica in enumerate(rows):
        for j, (tiles, tokens) in enumerate(replica):
            out[r, j, 0], out[r, j, TILES], out[r, j, TOKENS] = 1, tiles, tokens
    return out


def check_dependencies(step) -> None:
    """Every task ran whole, after what it needs (plus the transfer), and no GPU ran two tasks at once."""
    run, tasks = step.run, step.tasks
    starts: dict[int, float] = {}
    spent: dict[int, float] = {}
    for device, intervals in run.intervals.items():
        for (s0, e0, _), (s1, _, _) in zip(intervals, intervals[1:]):
            assert s1 >= e0 - 1e-9, f"device {device} overlaps"
        for s, e, i in intervals:
            assert tasks[i].device == device
            starts[i] = min(starts.get(i, math.inf), s)
            spent[i] = spent.get(i, 0.0) + e - s
    for i, task in enumerate(tasks):
        assert spent.get(i, 0.0) == pytest.approx(task.seconds, abs=1e-9)
        if task.seconds == 0:
            continue
        assert starts[i] >= task.release - 1e-9
        for j, delay in task.needs:
            assert starts[i] >= run.end[j] + delay - 1e-9, f"{task} started before {tasks[j]} arrived"


def test_two_stages_by_hand():
    # 1F1B, 2 stages, 2 microbatches, F = 1 s and B = 2 s per stage, every boundary crossing costs c:
    # s0 F0 [0,1] F1 [1,2]; s1 F0 [1+c,2+c] B0 [2+c,4+c] F1 [4+c,5+c] B1 [5+c,7+c]; s0 B0 [4+2c,6+2c] B1 [7+2c,9+2c]
    bandwidth = Cluster(2, gpus_per_node=1, inter_gbs=1.0, latency_s=0.0)
    table = table_of([], [(1.0, 2.0), (1.0, 2.0)], out_bytes=0.25e9)  # 0.25 GB per token at 1 GB/s: c = 0.25 s
    layout = Placement("stages", dp=1, pp=2)
    costs = step_costs(table, bandwidth, layout, [0, 1, 2])
    step = simulate_step(costs, layout, loads_of([[(0, 1), (0, 1)]]), bandwidth, keep_run=True)
    assert step.step_s == pytest.approx(9 + 2 * 0.25)
    check_dependencies(step)
    assert step.bubble_fractions()["stage 1"] == pytest.approx(1 - 6 / 9.5)


def test_bubbles_by_hand():
    # 2 stages, 1 microbatch of 2 tiles: each GPU encodes 1 tile (EF 1 s, EB 2 s). Stage 0's forward waits for
    # both halves (they run first, urgently); the encoder backwards wait for stage 0's backward:
    # EF [0,1]; s0 F [1,2]; s1 F [2,3] B [3,5]; s0 B [5,7]; EB on both [7,9].
    cluster = Cluster(2, latency_s=0.0)
    table = table_of([(1.0, 2.0)], [(1.0, 2.0), (1.0, 2.0)])
    layout = Placement("bubbles", dp=1, pp=2)
    costs = step_costs(table, cluster, layout, [0, 1, 2])
    step = simulate_step(costs, layout, loads_of([[(2, 1)]]), cluster, keep_run=True)
    assert step.step_s == pytest.approx(9.0)
    check_dependencies(step)
    stages = Placement("stages", dp=1, pp=2)
    alone = simulate_step(step_costs(table, cluster, stages, [0, 1, 3]), stages, loads_of([[(2, 1)]]), cluster)
    # the encoder as stage 0 (2 tiles: F 2 s, B 4 s), both LLM layers as stage 1 (F 2 s, B 4 s), in sequence
    assert alone.step_s == pytest.approx(2 + 2 + 4 + 4)


def test_routed_encoder_by_hand():
    # 2 replicas, 1 stage each (the LLM: F 1 s, B 2 s per token), the encoder (F 1 s, B 2 s per tile); replica 0
    # consumes 4 tiles and 1 token, replica 1 none and 1 token. Routed 2 / 2: each encodes 2 tiles (F 2 s); the
    # all-to-all moves 2 tiles of 1 GB each at 1 GB/s across nodes: 2 s; LLM F+B 3 s; back 2 s; encoder B 4 s:
    # 2 + 2 + 3 + 2 + 4 = 13 s. Colocated (stages): replica 0 runs 4 tiles (F 4, B 8) and its token (3): 15 s.
    cluster = Cluster(2, gpus_per_node=1, inter_gbs=1.0, latency_s=0.0)
    table = table_of([(1.0, 2.0)], [(1.0, 2.0)], out_bytes=1e9)
    loads = loads_of([[(4, 1)], [(0, 1)]])
    routed = Placement("phases", dp=2, pp=1)
    from packfeed.trainer.simulate.routed import Routing

    routing = Routing.of_plan(np.array([0, 4, 5]), np.array([0, 1, 2, 3, 4]), np.array([0, 0, 1, 1, 1]),
                              np.array([1, 1, 1, 1, 0]), dp=2, microbatches=1, patches_per_tile=1)
    assert routing.moved[0].tolist() == [[2.0, 0.0], [2.0, 0.0]]
    step = simulate_step(step_costs(table, cluster, routed, [0, 1]), routed, loads, cluster,
                         routing=(routing.encoder_loads[0], routing.moved[0]))
    assert step.step_s == pytest.approx(13.0)
    stages = Placement("stages", dp=2, pp=1)
    assert simulate_step(step_costs(table, cluster, stages, [0, 2]), stages, loads, cluster).step_s == \
        pytest.approx(15.0)
    nothing_moved = Routing.of_plan(np.array([0, 4, 5]), np.array([0, 1, 2, 3, 4]), np.array([0, 0, 0, 0, 1]),
                                    np.array([1, 1, 1, 1, 0]), dp=2, microbatches=1, patches_per_tile=1)
    alone = simulate_step(step_costs(table, cluster, routed, [0, 1]), routed, loads, cluster,
                          routing=(nothing_moved.encoder_loads[0], nothing_moved.moved[0]))
    assert alone.step_s == pytest.approx(4 + 3 + 8)  # no all-to-all; the phases still run one after the other


def test_routed_simulation_needs_a_routed_plan_and_one_stage(tmp_path):
    lengths = write_lengths(tmp_path / "lengths.json", 1500, 6)
    record = json.loads(packfeed("simulate", "--lengths", str(lengths), "--dp", "8", "--pp", "1", "--tp", "2",
                                 "--microbatches", "4", "--strategy", "isf+phases", "--encoder", "phases",
                                 "--json").stdout)
    assert record["step_s"] > 0 and record["layout"]["encoder"] == "phases" and record["gpus"] == 16
    done = packfeed("simulate", "--lengths", str(lengths), "--dp", "8", "--pp", "1", "--encoder", "phases",
                    "--strategy", "isf+balance", check=False)
    assert done.returncode == 2 and "isf+phases" in done.stderr
    done = packfeed("simulate", "--lengths", str(lengths), "--dp", "8", "--pp", "2", "--encoder", "phases",
                    "--strategy", "isf+phases", check=False)
    assert done.returncode == 2 and "--pp 1" in done.stderr


@pytest.mark.parametrize("schedule, chunks", [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2)])
def test_every_schedule_runs_each_operation_once(schedule, chunks):
    for stage in range(4):
        order = pipeline_order(schedule, stage, 4, 8, chunks)
        expected = [(k, c, j) for k in "FB" for c in range(chunks) for j in range(8)]
        assert sorted(order) == sorted(expected)


@pytest.mark.parametrize("schedule, stages, chunks, m", [("1f1b", 2, 1, 2), ("1f1b", 4, 1, 8), ("1f1b", 3, 1, 1),
                                                       ("interleaved_1f1b", 2, 2, 4), ("interleaved_1f1b", 4, 2, 8),
                                                       ("interleaved_1f1b", 4, 3, 8)])
def test_uniform_pipelines_match_the_closed_form(schedule, stages, chunks, m):
    # 1F1B: (M + P - 1) microbatch times; Megatron's interleaving cuts the bubble to (P - 1) / v of one
    cluster = Cluster(stages, latency_s=0.0)
    table = table_of([], [(1.0, 2.0)] * (stages * chunks))
    layout = Placement("stages", dp=1, pp=stages, chunks=chunks, schedule=schedule)
    costs = step_costs(table, cluster, layout, list(range(stages * chunks + 1)))
    step = simulate_step(costs, layout, loads_of([[(0, 1)] * m]), cluster, keep_run=True)
    check_dependencies(step)
    assert step.step_s == pytest.approx((m * chunks + stages - 1) * 3.0)
    bubble = (stages - 1) / (m * chunks + stages - 1)
    assert np.mean(list(step.bubble_fractions().values())) == pytest.approx(bubble)


def test_1f1b_keeps_fewer_microbatches_in_flight_than_gpipe():
    for stage in range(4):
        for schedule, most in (("1f1b", 4 - stage), ("gpipe", 8)):
            in_flight = peak = 0
            for kind, _, _ in pipeline_order(schedule, stage, 4, 8):
                in_flight += 1 if kind == "F" else -1
                peak = max(peak, in_flight)
            assert peak == most  # what makes 1F1B's activation memory lower


def test_an_unbalanced_microbatch_costs_more_than_its_share():
    cluster = Cluster(4, latency_s=0.0)
    table = table_of([], [(1.0, 2.0)] * 4)
    layout = Placement("stages", dp=1, pp=4)
    costs = step_costs(table, cluster, layout, [0, 1, 2, 3, 4])
    even = simulate_step(costs, layout, loads_of([[(0, 1)] * 8]), cluster)
    skewed = simulate_step(costs, layout, loads_of([[(0, 1)] * 3 + [(0, 3)] + [(0, 1)] * 4]), cluster)
    assert skewed.step_s > even.step_s + 2 * 3.0  # same work as 2 extra microbatches, all in one, costs more


def test_the_slowest_replica_sets_the_step():
    cluster = Cluster(4, latency_s=0.0)
    table = table_of([], [(1e-3, 2e-3)] * 2)
    layout = Placement("stages", dp=2, pp=2)
    costs = step_costs(table, cluster, layout, [0, 1, 2])
    small, large = [(0, 100)] * 2, [(0, 300)] * 2
    both = simulate_step(costs, layout, loads_of([small, large]), cluster)
    alone = simulate_step(costs, Placement("stages", dp=1, pp=2), loads_of([large]), Cluster(2, latency_s=0.0))
    assert both.step_s == pytest.approx(alone.step_s)


def test_ranks_sharing_cores_slow_down_only_when_more_are_busy_than_cores():
    """A CPU host: 4 ranks of a uniform 1F1B pipeline on 2 cores run slower than on 4, never more than 2x."""
    table = table_of([], [(1.0, 2.0)] * 4)
    layout = Placement("stages", dp=1, pp=4)
    cluster = Cluster(4, latency_s=0.0)
    costs = step_costs(table, cluster, layout, [0, 1, 2, 3, 4])
    loads = loads_of([[(0, 1)] * 8])
    alone = simulate_step(costs, layout, loads, cluster)
    shared = simulate_step(costs, layout, loads, cluster, keep_run=True, cores=2)
    plenty = simulate_step(costs, layout, loads, cluster, cores=4)
    assert plenty.step_s == pytest.approx(alone.step_s)
    assert alone.step_s < shared.step_s < 2 * alone.step_s
    run = shared.run  # every task's work was done: its intervals, at half speed at most, cover it
    for i, task in enumerate(shared.tasks):
        spent = sum(e - s for d in run.intervals for s, e, k in run.intervals[d] if k == i)
        assert task.seconds - 1e-9 <= spent <= 2 * task.seconds + 1e-9


def synthetic_samples(n: int, seed: int) -> SampleLoads:
    rng = np.random.default_rng(seed)
    tiles = rng.choice([1, 1, 2, 3, 5, 7], n)
    tokens = tiles * 256 + rng.integers(20, 900, n)
    return SampleLoads.from_arrays(tiles, tokens)


@pytest.mark.parametrize("encoder", ["stages", "bubbles", "disaggregated"])
@pytest.mark.parametrize("schedule, chunks", [("1f1b", 1), ("interleaved_1f1b", 2), ("gpipe", 1)])
def test_real_model_steps_respect_every_dependency(encoder, schedule, chunks):
    table, shape = load_model("internvl-chat-1.5")
    workload = make_workload(synthetic_samples(400, 1), "isf+balance", 2, 4, 2, shape.patches_per_tile,
                             planner_cost_model(table, shape.patches_per_tile))
    cluster = Cluster(4 if encoder != "disaggregated" else 6, gpus_per_node=2)
    layout = Placement(encoder, dp=2, pp=2, chunks=chunks, schedule=schedule,
                    encoder_groups=2 if encoder == "disaggregated" else 0)
    from packfeed.trainer.simulate.predict import pipeline_costs

    costs, _ = pipeline_costs(table, cluster, layout, workload, "balanced")
    step = simulate_step(costs, layout, workload.loads[0], cluster, keep_run=True)
    check_dependencies(step)
    assert step.step_s >= max(step.run.last_task(d, step.tasks)[1] for d in step.run.intervals)


def test_the_tiles_of_a_step_are_shared_evenly():
    shares = split_tiles([5, 3, 1, 7, 2], 3)
    assert (shares.sum(axis=1) == [5, 3, 1, 7, 2]).all()
    assert shares.sum(axis=0).max() - shares.sum(axis=0).min() <= 1


def optimus_like_samples(n: int, images: int) -> SampleLoads:
    return SampleLoads.from_arrays(np.full(n, images), np.full(n, 2048))


def optimus_regime(images: int, schedule: str = "1f1b", chunks: int = 1):
    """Optimus's regime: ViT-22B + GPT-175B, TP 8, 32 microbatches per pipeline of 2 samples of 2048 tokens."""
    table, shape = load_model("vit22b-gpt175b")
    workload = make_workload(optimus_like_samples(2 * 32 * 2, images), "isf+balance", 2, 32, 4,
                             shape.patches_per_tile, planner_cost_model(table, shape.patches_per_tile), 0, 0, 2.0)
    cluster = Cluster(64)
    common = dict(pp=4, tp=8, schedule=schedule, virtual_stages=chunks)
    stages = simulate_plan(workload, table, cluster, Settings("stages", **common))
    bubbles = simulate_plan(workload, table, cluster, Settings("bubbles", **common))
    # the encoder fits: its compute vanishes into the bubbles (only its gradient reduction remains)
    no_compute = replace(table, forward_flops=table.forward_flops * ~table.encoder[:, None])
    hidden = simulate_plan(workload, no_compute, cluster, Settings("bubbles", **common))
    return stages, bubbles, hidden


@pytest.mark.parametrize("images, schedule, chunks", [(1, "1f1b", 1), (2, "1f1b", 1), (1, "interleaved_1f1b", 2),
                                                      (2, "gpipe", 1)])
def test_bubbles_never_exceed_stages_when_the_encoder_fits(images, schedule, chunks):
    stages, bubbles, hidden = optimus_regime(images, schedule, chunks)
    # the encoder fits: its compute vanished into the bubbles, but for the first microbatch's forward and the
    # last one's backward, which nothing can overlap
    assert bubbles.step_s <= hidden.step_s * 1.02
    assert bubbles.step_s <= stages.step_s
    assert bubbles.bubble_fraction < stages.bubble_fraction


def test_an_encoder_too_large_for_the_bubbles_shows():
    """The control: 8 images of 256 patches per sample fill its 2048 tokens; the 1F1B bubbles (3 / 35) are too
    small for that encoder, and its time shows in the step."""
    _, bubbles, hidden = optimus_regime(8)
    assert bubbles.step_s > hidden.step_s * 1.04


def test_bubbles_help_less_than_nothing_when_the_encoder_is_the_whole_job():
    """A control: when encoder work dwarfs the bubbles, placing it there cannot hide it."""
    table = table_of([(1.0, 2.0)] * 4, [(1e-4, 2e-4)] * 2)
    cluster = Cluster(2)
    loads = make_workload(SampleLoads.from_arrays(np.full(64, 4), np.full(64, 100)), "isf", 1, 4, 2, 1,
                          planner_cost_model(table, 1), 0, 0, 4.0)
    stages = simulate_plan(loads, table, cluster, Settings("stages", pp=2))
    bubbles = simulate_plan(loads, table, cluster, Settings("bubbles", pp=2))
    llm_only = replace(table, measured_seconds=table.measured_seconds * np.array([0, 0, 0, 0, 1, 1])[:, None, None])
    bare = simulate_plan(loads, llm_only, cluster, Settings("bubbles", pp=2))
    assert bubbles.step_s > 10 * bare.step_s  # the encoder's time shows: it did not vanish into bubbles
    assert bubbles.step_s <= stages.step_s * 1.05


@pytest.mark.parametrize("gpus, pp, tp, m", [(12, 2, 1, 4), (16, 2, 1, 8), (20, 2, 2, 4), (24, 4, 1, 8)])
def test_split_search_finds_the_exhaustive_optimum(gpus, pp, tp, m):
    table, shape = load_model("internvl-chat-1.5")
    workload = make_workload(synthetic_samples(600, gpus), "isf+balance", 4, m, pp, shape.patches_per_tile,
                             planner_cost_model(table, shape.patches_per_tile))
    cluster = Cluster(gpus, gpus_per_node=4)
    settings = Settings("disaggregated", pp=pp, tp=tp, search_steps=3)
    searched, _ = search_allocation(workload, table, cluster, settings)
    sweep, _ = search_allocation(workload, table, cluster, settings, exhaustive=True)
    assert sweep["simulated"] == sweep["candidates"] >= 2
    best = min(sweep["trials"], key=lambda t: t["epoch_s"])
    assert searched["objective_s"] == pytest.approx(best["epoch_s"])
    assert (searched["encoder_gpus"], searched["llm_dp"]) == (best["encoder_gpus"], best["llm_dp"])
    for trial in sweep["trials"]:
        assert trial["bound_s"] <= trial["epoch_s"] * (1 + 1e-9)  # the pruning bound is a lower bound
    fixed, _ = search_allocation(workload, table, cluster, replace(settings, encoder_gpus=sweep["trials"][0]
                                                                   ["encoder_gpus"]))
    assert fixed["encoder_gpus"] == sweep["trials"][0]["encoder_gpus"] and fixed["candidates"] == 1


def test_a_plans_encoder_split_decides_when_each_microbatch_is_ready():
    """With encoder ranks, each encoder GPU encodes what its plan assigns it, microbatch after microbatch: the
    same step with all its encoder work on one of the two encoder GPUs is slower, and the other sits idle."""
    from packfeed.trainer.simulate.predict import pipeline_costs

    table, shape = load_model("internvl-chat-1.5")
    workload = make_workload(synthetic_samples(300, 4), "isf+balance", 2, 4, 1, shape.patches_per_tile,
                             planner_cost_model(table, shape.patches_per_tile), encoder_ranks=2)
    assert workload.encoder_split.shape == (workload.steps, 2, 2, 4)
    assert np.allclose(workload.encoder_split.sum(axis=1), workload.useful[..., 1])  # every tile encoded once
    cluster = Cluster(4)
    layout = Placement("disaggregated", 2, 1, encoder_groups=2)
    costs, _ = pipeline_costs(table, cluster, layout, workload, "balanced")
    split = workload.encoder_split[0]
    balanced = simulate_step(costs, layout, workload.loads[0], cluster, encoder_split=split)
    lopsided = np.stack([split.sum(axis=0), np.zeros_like(split[0])])
    one_sided = simulate_step(costs, layout, workload.loads[0], cluster, encoder_split=lopsided)
    assert one_sided.step_s > balanced.step_s * 1.2
    assert one_sided.busy_s["encoder"][1] == 0 < balanced.busy_s["encoder"][1]


def test_encoder_deadlines_follow_the_first_stages_order():
    # 1F1B over 4 stages: the first stage runs F(j) right after B(j - 4) from j = 4 on; GPipe never does
    assert encoder_deadlines("1f1b", 4, 8) == {j: [(0, j - 4)] for j in range(4, 8)}
    assert encoder_deadlines("gpipe", 4, 8) == {}
    interleaved = encoder_deadlines("interleaved_1f1b", 2, 4, 2)
    assert all(chunk in (0, 1) and i < j for j, due in interleaved.items() for chunk, i in due)


def test_shapes_count_parameters_like_the_papers():
    internvl, optimus = PRESETS["internvl-chat-1.5"](), PRESETS["vit22b-gpt175b"]()
    assert internvl.layer_table().describe()["encoder_params"] == pytest.approx(5.9e9, rel=0.1)
    assert internvl.layer_table().describe()["llm_params"] == pytest.approx(19.9e9, rel=0.1)
    assert optimus.layer_table().describe()["encoder_params"] == pytest.approx(22e9, rel=0.05)
    assert optimus.layer_table().describe()["llm_params"] == pytest.approx(175e9, rel=0.05)
    gqa = Transformer(hidden=4096, layers=1, heads=32, kv_heads=8, ffn=14336, gated=True)
    assert gqa.layer_params == pytest.approx(218e6, rel=0.01)  # Llama-3-8B's layer


def write_lengths(path: Path, n: int, seed: int) -> Path:
    samples = synthetic_samples(n, seed)
    path.write_text(json.dumps([{"vit_num": int(v), "token_num": int(t), "image_flags": int(v)}
                                for v, t in zip(samples.vision, samples.tokens)]))
    return path


def packfeed(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "packfeed.cli", *args], capture_output=True, text=True,
                          timeout=300)
    if check:
        assert done.returncode == 0, done.stderr
    return done


ISSUE_COMMAND = ["--model", "internvl-chat-1.5", "--dp", "8", "--pp", "4", "--microbatches", "8"]


@pytest.mark.parametrize("strategy, encoder", [("isf+balance", "bubbles"), ("random-padded", "stages"),
                                               ("random", "disaggregated")])
def test_the_command_prints_the_json_line(tmp_path, strategy, encoder):
    lengths = write_lengths(tmp_path / "lengths.json", 3000, 0)
    args = ["--lengths", str(lengths), *ISSUE_COMMAND, "--strategy", strategy, "--encoder", encoder, "--json"]
    if encoder == "disaggregated":
        args += ["--gpus", "48"]
    done = packfeed("simulate", *args, "--timeline", str(tmp_path / "step.png"))
    record = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("step_s", "epoch_s", "bubble_fraction", "mfu", "bubble_per_stage"):
        assert key in record
    assert 0 < record["mfu"] < 1 and 0 <= record["bubble_fraction"] < 1
    assert record["epoch_s"] == pytest.approx(record["step_s"] * record["steps"])
    assert record["samples"] == 3000 and record["strategy"] == strategy
    assert (tmp_path / "step.png").read_bytes()[:4] == b"\x89PNG"
    assert "bubble fraction" in done.stderr


@pytest.mark.skipif(not LENGTHS.is_dir(), reason="needs ../shared/data/lengths")
def test_the_issue_command_on_the_real_lengths():
    files = [str(LENGTHS / "ai2d_train_12k.json"), str(LENGTHS / "chartqa_train_18k.json")]
    records = {}
    for strategy, encoder in [("isf+balance", "bubbles"), ("random-padded", "stages")]:
        done = packfeed("simulate", "--lengths", *files, *ISSUE_COMMAND, "--strategy", strategy, "--encoder",
                        encoder, "--json")
        records[strategy] = json.loads(done.stdout)
    assert records["isf+balance"]["epoch_s"] < records["random-padded"]["epoch_s"]
    assert records["isf+balance"]["mfu"] > records["random-padded"]["mfu"]


def test_a_plan_file_simulates_like_its_strategy(tmp_path):
    lengths = write_lengths(tmp_path / "lengths.json", 2000, 3)
    packfeed("index", "--from-lengths", str(lengths), "--out", str(tmp_path / "index"))
    packfeed("plan", "--index", str(tmp_path / "index"), "--dp", "4", "--microbatches", "4", "--pipeline-stages", "2",
             "--out", str(tmp_path / "plan.parquet"))
    from_plan = json.loads(packfeed("simulate", "--plan", str(tmp_path / "plan.parquet"), "--index",
                                    str(tmp_path / "index"), "--pp", "2", "--json").stdout)
    direct = json.loads(packfeed("simulate", "--lengths", str(lengths), "--dp", "4", "--microbatches", "4", "--pp",
                                 "2", "--json").stdout)
    assert from_plan["layout"]["dp"] == 4 and from_plan["steps"] > 0
    assert from_plan["samples"] == direct["samples"] == 2000
    # the command plans with the model's FLOPs as costs, `packfeed plan` with its default cost model: the same
    # model (InternVL-Chat-1.5), so the two plans balance alike
    assert from_plan["step_s"] == pytest.approx(direct["step_s"], rel=0.05)

    # a plan file edited to name a sample twice, or a negative sample: refused naming the file and the id
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "plan.parquet")
    ids = table.column("sample_id").to_numpy().copy()
    for name, edit, message in [("twice", (1, ids[0]), f"sample_id {ids[0]} is in 2 packs"),
                                ("negative", (2, -5), "sample_id -5 in a pack not marked empty")]:
        edited = ids.copy()
        edited[edit[0]] = edit[1]
        path = tmp_path / f"{name}.parquet"
        pq.write_table(table.set_column(table.column_names.index("sample_id"), "sample_id",
                                        pc.cast(edited, table.schema.field("sample_id").type)), path)
        done = packfeed("simulate", "--plan", str(path), "--index", str(tmp_path / "index"), "--json", check=False)
        assert done.returncode != 0 and f"{path}: {message}" in done.stderr and "Traceback" not in done.stderr, name


def test_a_measured_cost_model_and_a_shape_description_are_models(tmp_path):
    lengths = write_lengths(tmp_path / "lengths.json", 800, 4)
    measured = {"vision_linear": 1e-6, "vision_quadratic": 0, "llm_linear": 1e-6, "llm_quadratic": 0,
                "layers": [{"kind": kind, "forward": [1e-4, 1e-3 if kind == "vit" else 1e-5, 0],
                            "backward": [2e-4, 2e-3 if kind == "vit" else 2e-5, 1e-9], "params": 1000,
                            "output_bytes_per_unit": 512} for kind in ["vit"] * 2 + ["projector"] + ["llm"] * 4]}
    (tmp_path / "cost_model.json").write_text(json.dumps(measured))
    record = json.loads(packfeed("simulate", "--lengths", str(lengths), "--model", str(tmp_path / "cost_model.json"),
                                 "--dp", "2", "--pp", "2", "--microbatches", "2", "--encoder", "bubbles",
                                 "--json").stdout)
    assert record["mfu"] is None and record["step_s"] > 0
    shape = {"vision": {"hidden": 1024, "layers": 24, "heads": 16, "ffn": 4096},
             "llm": {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 8, "ffn": 14336, "gated": True,
                     "vocab": 128256},
             "patches_per_tile": 577, "tokens_per_tile": 576, "projector_params": 1024 * 4096 + 4096 * 4096}
    (tmp_path / "llava.json").write_text(json.dumps(shape))
    record = json.loads(packfeed("simulate", "--lengths", str(lengths), "--model", str(tmp_path / "llava.json"),
                                 "--dp", "2", "--pp", "2", "--microbatches", "2", "--json").stdout)
    assert 0 < record["mfu"] < 1


def test_bad_inputs_get_clear_errors(tmp_path):
    lengths = write_lengths(tmp_path / "lengths.json", 100, 5)
    done = packfeed("simulate", "--lengths", str(lengths), "--model", "gpt-9", check=False)
    assert done.returncode == 2 and "preset" in done.stderr
    done = packfeed("simulate", "--lengths", str(lengths), "--dp", "2", "--pp", "2", "--gpus", "6", check=False)
    assert done.returncode == 2 and "disaggregated" in done.stderr
    done = packfeed("simulate", "--lengths", str(lengths), "--dp", "2", "--pp", "2", "--microbatches", "3",
                    "--schedule", "interleaved_1f1b", "--virtual-stages", "2", check=False)
    assert done.returncode == 2 and "multiple of the stages" in done.stderr
    (tmp_path / "old.json").write_text(json.dumps({"vision_linear": 1, "vision_quadratic": 0, "llm_linear": 1,
                                                   "llm_quadratic": 0}))
    done = packfeed("simulate", "--lengths", str(lengths), "--model", str(tmp_path / "old.json"), check=False)
    assert done.returncode == 2 and "per-layer" in done.stderr
    done = packfeed("simulate", check=False)
    assert done.returncode == 2 and "--lengths" in done.stderr


def test_sharded_data_parallelism_makes_each_phase_wait_for_its_slowest_rank():
    """Under FSDP / ZeRO-3 every layer is a barrier: two ranks with the same total work, one heavy on the
    encoder and the other on the LLM, run a step of (slowest encoder) + (slowest LLM), where DDP at pp 1 runs
    the larger total; balancing each phase (the routed encoder) removes the difference. Gathers and reductions
    of real parameters add time on top."""
    from packfeed.trainer.simulate.sharded import sharded_step

    table = table_of([(1.0, 2.0)] * 2, [(0.01, 0.02)] * 2)
    table.params[:] = 0.0  # no parameters to move: barriers alone
    cluster = Cluster(2)
    mixed = loads_of([[(4, 100)], [(1, 400)]])  # encoder 4 vs 1 tiles, LLM 100 vs 400 tokens
    per_rank = [sum(mixed[r, 0] @ table.measured_seconds[i].sum(axis=0) for i in range(4)) for r in range(2)]
    sharded = sharded_step(table, cluster, mixed)
    ddp = simulate_step(step_costs(table, cluster, Placement("stages", 2, 1), [0, 4]), Placement("stages", 2, 1), mixed,
                        cluster)
    slowest_phases = 2 * (4 * 3.0) + 2 * (400 * 0.03)  # both encoder layers at 4 tiles, both LLM layers at 400
    # one layer of prefetch lets a rank run at most one op (here 8 s: a backward at 4 tiles) ahead of the slowest
    assert slowest_phases - 8.0 <= sharded.step_s <= slowest_phases
    assert ddp.step_s == pytest.approx(max(per_rank)) and sharded.step_s > 1.4 * ddp.step_s
    # the encoder routed so each rank encodes 2.5 tiles: the encoder phase is balanced, the LLM's still waits
    routed = sharded_step(table, cluster, mixed, routing=(np.array([[1, 2.5, 0, 0, 0]] * 2), np.zeros((2, 2))))
    assert 2 * 2.5 * 3.0 + 2 * 400 * 0.03 - 8.0 <= routed.step_s < sharded.step_s
    table.params[:] = 1e9  # 1B parameters a layer: gathered and reduce-scattered over the two ranks
    assert sharded_step(table, cluster, mixed).step_s > sharded.step_s + 4 * cluster.ring_seconds(2e9, [0, 1])


def test_packfeed_simulate_data_parallel_zero3_from_the_command_line(tmp_path):
    lengths = tmp_path / "lengths.json"
    rng = np.random.default_rng(0)
    lengths.write_text(json.dumps([{"vit_num": int(v), "token_num": int(v) * 256 + int(t), "image_flags": int(v)}
                                   for v, t in zip(rng.choice([0, 1, 3, 6], 400), rng.integers(50, 2000, 400))]))
    common = [sys.executable, "-m", "packfeed.cli", "simulate", "--lengths", str(lengths), "--dp", "8",
              "--pp", "1", "--microbatches", "2", "--json"]
    records = {}
    for strategy, encoder in (("random", "stages"), ("isf+phases", "phases")):
        done = subprocess.run(common + ["--strategy", strategy, "--encoder", encoder, "--data-parallel", "zero3"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        records[strategy] = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(r["data_parallel"] == "zero3" and r["epoch_s"] > 0 for r in records.values())
    assert records["isf+phases"]["epoch_s"] < records["random"]["epoch_s"]
    refused = subprocess.run(common + ["--pp", "2", "--data-parallel", "fsdp"], capture_output=True, text=True,
                             timeout=300)
    assert refused.returncode != 0 and "--pp 1" in refused.stderr
