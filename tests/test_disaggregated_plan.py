"""Plans with the encoder on ranks of its own (`encoder_ranks` E > 0, issue [4/6]): property tests of their
guarantees (every sample once, each LLM rank M packs a step, every item encoded once on one of the E encoder
ranks, each step's encoder work balanced over them, determinism), the plan file and the summary."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packfeed.server.plan.costs import SampleLoads, sample_costs
from packfeed.server.plan.plan_file import read_plan
from packfeed.server.plan.planner import make_plan
from packfeed.v1.options import PlanConfig

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def image_mixes(draw):
    n = draw(st.integers(1, 160))
    vision = draw(st.lists(st.integers(0, 12), min_size=n, max_size=n))
    tokens = [v * 256 + draw(st.integers(16, 900)) for v in vision]
    return SampleLoads.from_arrays(vision, tokens)


@st.composite
def disaggregated_configs(draw):
    return PlanConfig(dp=draw(st.integers(1, 4)), microbatches=draw(st.integers(1, 3)),
                      encoder_ranks=draw(st.integers(1, 5)),
                      strategy=draw(st.sampled_from(["isf+balance", "isf", "isf+phases"])))


def step_of_members(plan) -> np.ndarray:
    return np.repeat(np.arange(plan.n_packs) // plan.config.slots, np.diff(plan.offsets))


@SETTINGS
@given(loads=image_mixes(), config=disaggregated_configs(), seed=st.integers(0, 2**31))
def test_every_item_encoded_once_on_an_encoder_rank_and_each_llm_rank_gets_m_packs(loads, config, seed):
    plan = make_plan(loads, config, seed, 0)
    assert np.array_equal(np.sort(plan.members), np.arange(len(loads)))
    assert plan.n_packs == plan.n_steps * config.slots, "an LLM rank without its M packs in a step"
    assert len(plan.encoder_rank) == len(plan.members)  # one encoder rank per sample: its items' encoder
    assert ((plan.encoder_rank >= 0) & (plan.encoder_rank < config.encoder_ranks)).all()
    # each step's encoder work over the E ranks: within list scheduling's bound (mean + largest item)
    costs = sample_costs(config.cost_model, loads)[plan.members, 0].astype(np.float64)
    step = step_of_members(plan)
    for s in range(plan.n_steps):
        mine = step == s
        load = np.bincount(plan.encoder_rank[mine], costs[mine], minlength=config.encoder_ranks)
        if mine.any():
            assert load.max() <= costs[mine].sum() / config.encoder_ranks + costs[mine].max() + 1e-9


@SETTINGS
@given(loads=image_mixes(), config=disaggregated_configs(), seed=st.integers(0, 2**31))
def test_same_inputs_same_plan(loads, config, seed):
    a, b = make_plan(loads, config, seed, 2), make_plan(loads, config, seed, 2)
    assert a.fingerprint() == b.fingerprint() and np.array_equal(a.encoder_rank, b.encoder_rank)


def image_mix(n: int = 2000, seed: int = 0) -> SampleLoads:
    rng = np.random.default_rng(seed)
    vision = rng.choice([0, 1, 3, 5, 9, 13], size=n, p=[0.2, 0.3, 0.2, 0.15, 0.1, 0.05])
    return SampleLoads.from_arrays(vision, vision * 256 + rng.integers(30, 1500, n))


def test_encoder_ranks_balance_their_own_work_and_the_summary_says_so():
    loads = image_mix()
    plan = make_plan(loads, PlanConfig(dp=6, microbatches=2, encoder_ranks=4), 0, 0)
    phases = plan.summary(loads)["phases"]
    assert phases["encoder_ranks"] == 4
    assert phases["vit_cost_dist"] < phases["vit_cost_dist_colocated"]  # balanced on its own, over E ranks
    assert phases["all_to_all_units"] == float(loads.vision.sum())  # every output leaves its encoder rank
    # the E ranks need not divide the dp ranks, nor the other way round
    assert set(np.unique(plan.encoder_rank).tolist()) == {0, 1, 2, 3}


def test_plan_file_names_encoder_ranks_and_round_trips(tmp_path):
    loads = image_mix(600)
    plan = make_plan(loads, PlanConfig(dp=3, microbatches=2, encoder_ranks=2), 5, 1)
    path = tmp_path / "plan.parquet"
    plan.write(path)
    again = read_plan(path)
    assert again.config.encoder_ranks == 2 and np.array_equal(again.encoder_rank, plan.encoder_rank)
    assert again.fingerprint() == plan.fingerprint()


def test_config_refuses_what_does_not_combine():
    for bad, field in (({"encoder_ranks": -1}, "encoder_ranks must be >= 0"),
                       ({"encoder_ranks": 2, "strategy": "random"}, "strategy isf"),
                       ({"encoder_ranks": 2, "context_parallel": 2}, "do not combine yet"),
                       ({"pipeline_stages": 2, "context_parallel": 2}, "runs at pp 1"),
                       ({"encoder_ranks": 2, "strategy": "isf+phases", "colocate_encoder": True}, "colocate_encoder")):
        with pytest.raises(ValueError, match=field):
            PlanConfig(dp=2, **bad)
    assert "encoder_ranks" not in PlanConfig(dp=2).to_dict()  # plans before it keep their fingerprints


@SETTINGS
@given(loads=image_mixes(), config=disaggregated_configs(), seed=st.integers(0, 2**31))
def test_every_microbatch_prefix_of_a_step_is_balanced_over_the_encoder_ranks(loads, config, seed):
    """Encoder ranks encode microbatch m + 1 while the LLM trains on m: the plan balances every prefix of a step's
    microbatches (within list scheduling's bound), so no exchange waits long on one encoder rank."""
    plan = make_plan(loads, config, seed, 0)
    costs = sample_costs(config.cost_model, loads)[plan.members, 0].astype(np.float64)
    step = step_of_members(plan)
    microbatch = np.repeat(np.arange(plan.n_packs) % config.microbatches, np.diff(plan.offsets))
    for s in range(plan.n_steps):
        for m in range(config.microbatches):
            mine = (step == s) & (microbatch <= m)
            if mine.any():
                load = np.bincount(plan.encoder_rank[mine], costs[mine], minlength=config.encoder_ranks)
                assert load.max() <= costs[mine].sum() / config.encoder_ranks + costs[mine].max() + 1e-9


def test_packfeed_simulate_plans_each_split_it_searches_and_reports_the_chosen_one(tmp_path):
    """`--encoder disaggregated` simulates each split on its own plan (encoder_ranks E, the step's packs shared by
    the replicas): the chosen split is the best simulated epoch, and a plan file with encoder ranks is simulated
    as planned (its own split, with the plan's per-rank encoder work)."""
    import json
    import subprocess
    import sys

    from packfeed.server.plan.costs import SampleLoads
    from packfeed.trainer.simulate.cluster import Cluster
    from packfeed.trainer.simulate.model_shape import load_model
    from packfeed.trainer.simulate.predict import Settings, search_allocation
    from packfeed.trainer.simulate.workload import planner_cost_model
    from packfeed.cli.simulate_data import make_workload

    table, shape = load_model("internvl-chat-1.5")
    rng = np.random.default_rng(3)
    vision = rng.choice([1, 2, 4, 6, 12], size=900)
    loads = SampleLoads.from_arrays(vision, vision * 256 + rng.integers(100, 3000, 900))
    cost = planner_cost_model(table, shape.patches_per_tile)

    def replan(replicas: int, encoder_ranks: int):
        return make_workload(loads, "isf+balance", replicas, 32 // replicas, 2, shape.patches_per_tile, cost,
                             encoder_ranks=encoder_ranks)
    base = make_workload(loads, "isf+balance", 4, 8, 2, shape.patches_per_tile, cost)
    settings = Settings("disaggregated", pp=2, search_steps=3)
    searched, chosen = search_allocation(base, table, Cluster(16, gpus_per_node=8), settings, replan)
    sweep, _ = search_allocation(base, table, Cluster(16, gpus_per_node=8), settings, replan, exhaustive=True)
    best = min(sweep["trials"], key=lambda t: t["epoch_s"])
    assert searched["replanned"] and sweep["simulated"] == sweep["candidates"] >= 3
    assert (searched["encoder_gpus"], searched["llm_dp"]) == (best["encoder_gpus"], best["llm_dp"])
    assert all(t["bound_s"] <= t["epoch_s"] * (1 + 1e-9) for t in sweep["trials"])
    assert chosen.encoder_split.shape[1:3] == (searched["encoder_gpus"], searched["llm_dp"])

    index = tmp_path / "lengths.json"
    index.write_text(json.dumps([{"vit_num": int(v), "token_num": int(t), "image_flags": int(v)}
                                 for v, t in zip(loads.vision, loads.tokens)]))
    common = [sys.executable, "-m", "packfeed.cli"]
    subprocess.run(common + ["index", "--from-lengths", str(index), "--out", str(tmp_path / "index.parquet")],
                   check=True, capture_output=True)
    subprocess.run(common + ["plan", "--index", str(tmp_path / "index.parquet"), "--dp", "4", "--microbatches", "4",
                             "--encoder-ranks", "3", "--out", str(tmp_path / "plan.parquet")], check=True,
                   capture_output=True)
    done = subprocess.run(common + ["simulate", "--index", str(tmp_path / "index.parquet"), "--plan",
                                    str(tmp_path / "plan.parquet"), "--encoder", "disaggregated", "--pp", "1",
                                    "--gpus", "7", "--json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert (record["search"]["encoder_gpus"], record["search"]["llm_dp"]) == (3, 4)
    assert not record["search"]["replanned"] and record["epoch_s"] > 0
