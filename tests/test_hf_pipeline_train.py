"""`packfeed train model.hf=FAMILY parallel.pp=2` end to end (torchrun, gloo, an embedded server over real
gRPC): it resumes from a sharded checkpoint at exactly the next step, the partition search beats the layer-count
split on a model whose vision blocks cost several decoder blocks, adaptive recompute fits a budget that keeping
everything exceeds and recomputes less than everything."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from doc_commands import commands_run_by  # noqa: E402
from hf_models import family_dataset  # noqa: E402
from trainer_workers import packfeed_train, restart_from  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def internvl_data(tmp_path_factory):
    return family_dataset(tmp_path_factory.mktemp("internvl"), "internvl", samples=60)


@pytest.fixture(scope="module")
def qwen_data(tmp_path_factory):
    return family_dataset(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl", samples=60)


HEAVY_VISION = ("model.hf_config={text: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 6}, "
                "vision: {embed_dim: 512, num_heads: 8, depth: 6, mlp_ratio: 4}}")


def test_searched_partition_is_faster_than_the_layer_count_split(tmp_path, qwen_data):
    """Vision blocks several times a decoder block's cost: the layer-count split puts every vision block on
    stage 0. The profiled ranking puts vision blocks on both stages, its best candidate's stages far more even
    than the layer-count split's; the trials time both, and the run trains with whichever was measured fastest
    (which of two step times a few percent apart wins on a loaded machine is a benchmark's figure,
    tests/benchmarks/test_bench_hf_pipeline.py, not a unit test's)."""
    # 6 microbatches: with few, the pipeline's fill and drain hide any split's imbalance
    overrides = ["model.hf=qwen2_vl", f"data.index={qwen_data.index}", "parallel.pp=2", "data.microbatches=6",
                 "data.epochs=4", "optim.steps=2", "partition.radius=2", "partition.top_k=1",
                 "partition.trial_steps=2", "recompute.mode=none", HEAVY_VISION]
    log, records = packfeed_train(2, overrides, tmp_path / "search")
    decision = json.loads((tmp_path / "search" / "partition.json").read_text())
    timed = [c for c in decision["candidates"] + decision["baselines"] if c["measured_s"]]
    layer_count = next(c for c in decision["baselines"] if c["origin"] == "layer-count")
    ranked_first = decision["candidates"][0]
    assert layer_count["measured_s"] and ranked_first["measured_s"]  # both were timed
    assert decision["bounds"] == min(timed, key=lambda c: c["measured_s"])["bounds"]
    assert ranked_first["bounds"] != layer_count["bounds"]
    def imbalance(candidate):
        return max(candidate["stage_s"]) / min(candidate["stage_s"])
    assert imbalance(ranked_first) * 2 < imbalance(layer_count), (ranked_first, layer_count)
    kinds = decision["kinds"]
    assert kinds[:ranked_first["bounds"][1]].count("vit") < kinds.count("vit")  # vision blocks on both stages
    assert kinds[:layer_count["bounds"][1]].count("vit") == kinds.count("vit")  # ... where layer count has none
    assert [row["stage"] for row in decision["stages"]] == [0, 1]
    assert len(records) == 2 and records[0]["loss"] > 0
    # (that the trials leave weights, optimizer and stream as they were, and a saved decision reused by the next
    # run: tests/test_trainer_pipeline.py, the same code for every model)


def stage_rows(out) -> list[dict]:
    return json.loads((out / "partition.json").read_text())["stages"]


def test_adaptive_recompute_fits_where_keeping_everything_does_not_and_recomputes_less_than_everything(
        tmp_path, qwen_data):
    """The speed this buys is a benchmark's figure (tests/benchmarks/test_bench_hf_pipeline.py), not a unit test's:
    on a shared machine two step times a few percent apart can come out either way."""
    common = ["model.hf=qwen2_vl", f"data.index={qwen_data.index}", "parallel.pp=2", "data.microbatches=2",
              "data.epochs=3", "optim.steps=1", "partition.bounds=[0,8,13]",
              "model.hf_config={text: {hidden_size: 128, intermediate_size: 512, num_hidden_layers: 6}, "
              "vision: {embed_dim: 64, depth: 3}}"]
    _, _ = packfeed_train(2, common + ["recompute.mode=none"], tmp_path / "none")
    none = stage_rows(tmp_path / "none")
    high = max(row["rank_peak_mib"] for row in none)
    budget = 0.8 * high  # keeping every block does not fit on the heaviest stage
    log, records = packfeed_train(2, common + [f"recompute.budget_mb={budget}"], tmp_path / "adaptive")
    adaptive = stage_rows(tmp_path / "adaptive")
    decisions = [json.loads((tmp_path / "adaptive" / f"recompute-stage{s}.json").read_text()) for s in range(2)]
    # the adaptive run's own trial with every block recomputed (what recompute.mode=all keeps) fits with room
    everything = [d["measured"]["all"] / 2**20 for d in decisions]
    assert all(low < row["rank_peak_mib"] for low, row in zip(everything, none))
    assert max(everything) < budget
    assert all(d["fits"] for d in decisions)
    assert all(row["rank_peak_mib"] <= budget for row in adaptive)
    recomputed = sum(r["recomputed_vision"] + r["recomputed_llm"] for r in adaptive)
    assert 0 < recomputed < 3 + 6  # of the 3 vision blocks and 6 decoder layers
    assert records and records[0]["loss"] > 0


def test_the_readme_commands_train_a_pipelined_qwen2_vl_as_written(tmp_path):
    """On the demo dataset: index with the qwen2_vl preset, then train at pp=2 with the partition search."""
    import math
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    subprocess.run(["packfeed", "demo", "--out", "demo-out", "--dataset-only"], cwd=tmp_path, env=env, check=True,
                   capture_output=True)
    index, train = commands_run_by("tests/test_hf_pipeline_train.py")
    assert index.startswith("packfeed index") and train.startswith("packfeed train") and "parallel.pp=2" in train
    # indexing exits 3: the demo holds three broken samples on purpose, skipped and reported
    for command, ok in ((index, (0, 3)), (train, (0,))):
        done = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode in ok, done.stderr[-3000:]
    partition = json.loads((tmp_path / "OUT" / "partition.json").read_text())
    assert len(partition["bounds"]) == 3 and [row["stage"] for row in partition["stages"]] == [0, 1]
    records = [json.loads(line) for line in (tmp_path / "OUT" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in records)
    # (that a pipelined step's loss and gradients are the unpipelined model's: tests/test_hf_pipeline.py)


def test_fsdp2_inside_stages_trains_and_resumes_at_exactly_the_next_step(tmp_path, internvl_data):
    """DP 2 x PP 2 with FSDP2 within each stage (InternVL's tied embedding on stage 0 and its head on stage 1, left
    whole and averaged): the per-stage table's measured trial, clipping over shards and whole weights, and a
    sharded checkpoint that resumes at exactly the next step."""
    common = ["model.hf=internvl", f"data.index={internvl_data.index}", "parallel.pp=2", "parallel.dp=2",
              "parallel.data_parallel=fsdp", "data.microbatches=2", "data.epochs=3", "checkpoint.every=2",
              "optim.warmup_steps=1", "optim.clip_grad_norm=0.01", "partition.bounds=[0,5,8]", "recompute.mode=none",
              "model.hf_config={text: {hidden_size: 32, num_hidden_layers: 2}, vision: {num_hidden_layers: 2}}"]
    _, straight = packfeed_train(4, common + ["optim.steps=3"], tmp_path / "straight")
    restart_from(tmp_path / "straight", tmp_path / "resumed", 2)  # as if stopped after its checkpoint at step 2
    log, resumed = packfeed_train(4, common + ["optim.steps=3"], tmp_path / "resumed")
    assert "resuming from" in log and "after 2 steps" in log
    assert len(straight) == 3 and all(r["grad_norm"] > 0.01 for r in straight)  # every step clipped
    assert [(r["epoch"], r["step"]) for r in resumed] == [(r["epoch"], r["step"]) for r in straight]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in straight], rel=1e-6)
    assert straight[-1]["loss"] < straight[0]["loss"]
    assert (tmp_path / "resumed" / "checkpoints" / "step-000002" / "sharded").is_dir()
    assert [row["stage"] for row in json.loads((tmp_path / "straight" / "partition.json").read_text())["stages"]] \
        == [0, 1]
