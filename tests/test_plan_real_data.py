"""The planner on the real InternVL-1.2M subsets, at OmniBal's own caps and with automatic caps."""

from __future__ import annotations


from packfeed.server.plan.caps import search_caps
from packfeed.server.plan.costs import load_sample_loads
from packfeed.server.plan.planner import make_plan
from packfeed.v1.options import PlanConfig

OMNIBAL_PACKS = 7394


def test_isf_baseline_matches_omnibal_published_behaviour(real_index):
    loads, _ = load_sample_loads(real_index)
    plan = make_plan(loads, PlanConfig(dp=8, strategy="isf", vision_cap=16, token_cap=5376, token_target=5248), 0, 0)
    summary = plan.summary(loads)
    # OmniBal's code reports ViT 0.003 / LLM 0.042 here; our port of its random step formation lands nearby.
    assert 0.001 < summary["vit_dist"] < 0.01
    assert 0.02 < summary["llm_dist"] < 0.07


def test_isf_balance_beats_targets_on_real_data(real_index):
    loads, _ = load_sample_loads(real_index)
    plan = make_plan(loads, PlanConfig(dp=8, vision_cap=16, token_cap=5376, token_target=5248), 0, 0)
    summary = plan.summary(loads)
    assert summary["samples"] == 30730
    assert summary["llm_dist"] <= 0.01
    assert summary["vit_dist"] <= 0.001
    assert summary["packs"] <= OMNIBAL_PACKS * 1.01
    assert summary["pad_ratio"] == 0


def test_automatic_caps_reproduce_omnibal_search(real_index):
    loads, _ = load_sample_loads(real_index)
    caps, tried = search_caps(loads.vision, loads.tokens, dp=8, samples_per_pack=4, iterations=10)
    assert (caps.vision_cap, caps.token_cap, caps.token_target) == (16, 5376, 5248)
    assert len(tried) >= 2


def test_random_batches_are_unbalanced_like_the_paper(real_index):
    loads, _ = load_sample_loads(real_index)
    summary = make_plan(loads, PlanConfig(dp=8, strategy="random"), 0, 0).summary(loads)
    assert summary["pad_ratio"] > 0.15 and summary["vit_dist"] > 0.1
