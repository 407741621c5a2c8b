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
                       ({"encoder_ranks": 2, "context_parallel": 2}, "context_parallel"),
                       ({"encoder_ranks": 2, "strategy": "isf+phases", "colocate_encoder": True}, "colocate_encoder")):
        with pytest.raises(ValueError, match=field):
            PlanConfig(dp=2, **bad)
    assert "encoder_ranks" not in PlanConfig(dp=2).to_dict()  # plans before it keep their fingerprints
