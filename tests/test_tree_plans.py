"""Plans of trees of trajectories (issue [5/6]): a fork continues its parent (its first S tokens and the images
there are its parent's), and the planner costs a tree by its unique tokens and vision units. Checked by code of
the test's own over random forests and configs: every trajectory once, the caps with each shared turn counted
once per pack, a tree that fits in one pack, collective safety, and the summary's savings."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packfeed.server.plan.costs import SampleLoads
from packfeed.server.plan.planner import make_plan
from packfeed.v1.options import Oversize, PlanConfig, Strategy


def forest_loads(n_trees: int, size: int, seed: int, alone: int = 0) -> SampleLoads:
    """n_trees trees of up to `size` trajectories (each fork from a random earlier one of its tree, at a random
    point), then `alone` trajectories of no tree; ids shuffled so a tree's members are not adjacent."""
    rng = np.random.default_rng(seed)
    tokens, vision, shares, shared_vision, parent, group = [], [], [], [], [], []
    for tree in range(n_trees):
        first = len(tokens)
        for k in range(int(rng.integers(1, size + 1))):
            own_tokens, own_vision = int(rng.integers(20, 600)), int(rng.integers(0, 4))
            if k == 0:
                p, s, sv = -1, 0, 0
            else:
                p = first + int(rng.integers(0, k))
                s = int(rng.integers(2, tokens[p] + 1))
                sv = int(round(vision[p] * s / tokens[p]))
            tokens.append(s + own_tokens + 64 * own_vision)
            vision.append(sv + own_vision)
            shares.append(s), shared_vision.append(sv), parent.append(p), group.append(tree)
    for _ in range(alone):
        extra = int(rng.integers(0, 3))
        tokens.append(int(rng.integers(30, 900)) + 64 * extra), vision.append(extra)
        shares.append(0), shared_vision.append(0), parent.append(-1), group.append(-1)
    order = rng.permutation(len(tokens))
    place = np.empty(len(order), np.int64)
    place[order] = np.arange(len(order))
    loads = SampleLoads.from_arrays(np.asarray(vision)[order], np.asarray(tokens)[order])
    loads.group = np.asarray(group, np.int64)[order]
    loads.prefix = np.asarray(shares, np.int32)[order]
    loads.shared_vision = np.asarray(shared_vision, np.int32)[order]
    old_parent = np.asarray(parent, np.int64)[order]
    loads.parent = np.where(old_parent >= 0, place[np.maximum(old_parent, 0)], -1)
    return loads


def packs_of(plan) -> list[np.ndarray]:
    return [plan.members[a:b].astype(np.int64) for a, b in zip(plan.offsets[:-1], plan.offsets[1:])]


def computed(pack: np.ndarray, loads: SampleLoads) -> tuple[int, int, int]:
    """(tokens, vision units, tokens shared) a pack computes: a fork whose parent is in the pack adds what follows
    its fork, any other sample its whole trajectory."""
    inside = set(pack.tolist())
    tokens = vision = saved = 0
    for i in pack.tolist():
        shared = int(loads.parent[i]) in inside
        tokens += int(loads.tokens[i]) - (int(loads.prefix[i]) if shared else 0)
        vision += int(loads.vision[i]) - (int(loads.shared_vision[i]) if shared else 0)
        saved += int(loads.prefix[i]) if shared else 0
    return tokens, vision, saved


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_trees=st.integers(1, 30), size=st.sampled_from([1, 3, 8, 16]), alone=st.integers(0, 30),
       seed=st.integers(0, 2**31), dp=st.integers(1, 5), m=st.integers(1, 3),
       strategy=st.sampled_from([Strategy.ISF_BALANCE, Strategy.ISF]))
def test_tree_plans_take_each_trajectory_once_within_the_caps_counting_shared_turns_once(n_trees, size, alone, seed,
                                                                                        dp, m, strategy):
    loads = forest_loads(n_trees, size, seed, alone)
    config = PlanConfig(dp=dp, microbatches=m, strategy=strategy, oversize=Oversize.ALONE)
    plan = make_plan(loads, config, seed, 0)
    caps = plan.caps
    members = plan.members.astype(np.int64)
    assert sorted(members.tolist()) == list(range(len(loads)))  # every trajectory once
    over = set(plan.oversize.tolist())
    saved = 0
    for pack in packs_of(plan):
        tokens, vision, pack_saved = computed(pack, loads)
        saved += pack_saved
        if len(pack) > 1:  # a pack of one may be a trajectory over the caps alone (oversize alone)
            assert tokens <= caps.token_cap and vision <= caps.vision_cap, (pack, tokens, vision, caps)
    # a tree that fits the caps is computed in one pack, unless cut to keep the towers aligned
    where = {int(i): p for p, pack in enumerate(packs_of(plan)) for i in pack}
    for tree in set(loads.group.tolist()) - {-1}:
        ids = np.flatnonzero(loads.group == tree)
        tokens, vision, _ = computed(ids, loads)
        if tokens <= caps.token_cap and vision <= caps.vision_cap and not (set(ids.tolist()) & over) and \
                not (config.collective_safe and loads.towers[ids].any()):
            assert len({where[int(i)] for i in ids}) == 1, tree
    summary = plan.summary(loads)["groups"]
    assert summary["prefix_tokens_saved"] == saved


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_trees=st.integers(1, 30), seed=st.integers(0, 2**31), dp=st.integers(2, 5), m=st.integers(1, 3))
def test_tree_plans_stay_collective_safe(n_trees, seed, dp, m):
    loads = forest_loads(n_trees, 8, seed, alone=20)
    plan = make_plan(loads, PlanConfig(dp=dp, microbatches=m), seed, 0)
    calls = np.asarray([int(np.bitwise_or.reduce(loads.towers[p])) if len(p) else 0 for p in packs_of(plan)])
    columns = calls.reshape(-1, dp, m)
    bad = (columns.min(axis=1) == 0) & (columns.max(axis=1) > 0)
    assert bad[:-1].sum() <= 1
    assert int(bad.sum()) == plan.summary(loads)["collective_safe"]["unaligned_microbatches"]
    assert np.array_equal(np.sort(plan.members), np.arange(len(loads)))


def test_a_tree_costs_its_unique_tokens_not_each_trajectory_whole():
    """Eight trajectories of one tree, forks at two depths: planned with room for the tree's unique tokens (but
    not for every trajectory whole), they are one pack."""
    loads = forest_loads(1, 8, seed=3)
    unique, _, _ = computed(np.arange(len(loads)), loads)
    assert unique < int(loads.tokens.sum())
    plan = make_plan(loads, PlanConfig(dp=1, token_cap=unique, vision_cap=int(loads.vision.sum()) + 1), 0, 0)
    assert [len(p) for p in packs_of(plan) if len(p)] == [len(loads)]
    assert plan.summary(loads)["groups"]["prefix_tokens_saved"] == int(loads.tokens.sum()) - unique > 0
    tight = make_plan(loads, PlanConfig(dp=1, token_cap=unique - 1, vision_cap=int(loads.vision.sum()) + 1), 0, 0)
    assert len([p for p in packs_of(tight) if len(p)]) > 1  # cut into subtrees, each with its root path
