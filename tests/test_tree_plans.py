"""Plans of trees of trajectories (issue [5/6]): a fork continues its parent (its first S tokens and the images
there are its parent's), and the planner costs a tree by its unique tokens and vision units. Checked by code of
the test's own over random forests and configs: every trajectory once, the caps with each shared turn counted
once per pack, a tree that fits in one pack, collective safety, and the summary's savings."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from packfeed.server.plan.costs import SampleLoads
from packfeed.server.plan.planner import make_plan
from packfeed.v1.options import Oversize, PlanConfig, Strategy
from test_group_plans import assert_collective_safe


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
# a tree cut for collective safety whose piece, its forks' parents in the other piece, exceeded the vision cap
@example(n_trees=3, size=16, alone=3, seed=16, dp=3, m=3, strategy=Strategy.ISF_BALANCE)
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
    assert_collective_safe(forest_loads(n_trees, 8, seed, alone=20), dp, m, seed)


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


def trajectory_records(n_trees: int, size: int, seed: int) -> list[dict]:
    """Length records of trees of trajectories: a prompt (its tokens and screenshot), forks at random points of
    an earlier trajectory of the tree, each fork's own turns after it (tokens and images)."""
    rng = np.random.default_rng(seed)
    records: list[dict] = []
    for tree in range(n_trees):
        first, prompt = len(records), int(rng.integers(300, 900))
        records.append({"id": f"{tree}-0", "group": f"task-{tree}", "prefix_tokens": prompt, "prompt_vit_num": 2,
                        "vit_num": 5, "token_num": prompt + int(rng.integers(500, 3000))})
        for k in range(1, size):
            parent = records[first + int(rng.integers(0, k))]
            fork = int(rng.integers(prompt, parent["token_num"]))
            shared_vision = min(parent["vit_num"], 2 + (fork - prompt) // 800)
            own = int(rng.integers(0, 4))
            records.append({"id": f"{tree}-{k}", "group": f"task-{tree}", "prefix_tokens": prompt,
                            "prompt_vit_num": 2, "parent": parent["id"], "fork_tokens": fork,
                            "fork_vit_num": shared_vision, "vit_num": shared_vision + own,
                            "token_num": fork + 256 * own + int(rng.integers(100, 1500))})
    return records


def unique_tokens(records: list[dict]) -> int:
    """The test's own count: each trajectory's tokens after its fork, a root's whole."""
    return sum(r["token_num"] - r.get("fork_tokens", 0) for r in records)


def test_simulate_and_stats_report_a_trajectory_mix_tree_one_level_and_alone(tmp_path):
    """A length file of trees (`id`, `parent`, `fork_tokens`, ...): `packfeed simulate --json` reports LLM tokens,
    vision units and step and epoch time as trees, with one-level prefix sharing and each trajectory alone;
    `packfeed index --from-lengths` then `packfeed stats` compares the balanced plan the three ways."""
    import json
    import subprocess
    import sys

    from packfeed.server.index.lengths import index_from_lengths

    records = trajectory_records(40, 8, 5)
    (tmp_path / "trees.json").write_text(json.dumps(records))
    run = subprocess.run([sys.executable, "-m", "packfeed.cli", "simulate", "--lengths", str(tmp_path / "trees.json"),
                          "--dp", "8", "--microbatches", "2", "--json"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    groups = json.loads(run.stdout)["groups"]
    assert groups["llm_tokens_unshared"] == sum(r["token_num"] for r in records)
    assert groups["llm_tokens_shared"] >= unique_tokens(records)  # a tree cut over packs carries its root path
    assert groups["llm_tokens_shared"] < groups["llm_tokens_one_level"] < groups["llm_tokens_unshared"]
    assert groups["epoch_s_shared"] < groups["epoch_s_one_level"] and "one-level prefix sharing" in run.stderr

    info = index_from_lengths([tmp_path / "trees.json"], tmp_path / "i.parquet")
    assert info.groups and info.trees
    stats = subprocess.run([sys.executable, "-m", "packfeed.cli", "stats", "--index", str(tmp_path / "i.parquet"),
                            "--out", str(tmp_path / "report"), "--dp", "8"], capture_output=True, text=True)
    assert stats.returncode == 0, stats.stderr
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    rows = {row["strategy"]: row for row in report["comparison"]}
    tree, one, alone = (rows["isf+balance" + suffix]["llm_tokens"]
                        for suffix in ("", ", one-level prefix sharing", ", each sample alone"))
    assert unique_tokens(records) <= tree < one < alone == sum(r["token_num"] for r in records)
    assert "40 trees of trajectories" in report["groups_note"]


@pytest.mark.parametrize("change, message", [
    ({"parent": "nowhere"}, "no earlier record of its group"),
    ({"fork_tokens": 1}, "'fork_tokens' is 1"),
    ({"fork_vit_num": 99}, "'fork_vit_num' is 99"),
    ({"id": "0-0"}, "id of its own"),
])
def test_length_files_with_bad_trees_are_refused_naming_the_record(tmp_path, change, message):
    import json

    from packfeed.server.index.lengths import index_from_lengths

    records = trajectory_records(1, 3, 0)
    records[2].update(change)
    (tmp_path / "l.json").write_text(json.dumps(records))
    with pytest.raises(ValueError, match=f"record 2: .*{message}"):
        index_from_lengths([tmp_path / "l.json"], tmp_path / "i.parquet")
