"""Group-aware plans (issue [4/6]): a group's members share a prefix (the prompt and its images); the planner keeps
them in one pack where they fit, in as few packs as hold them where they do not, counts each prefix once per pack,
and keeps every guarantee (every sample once, caps, collective safety). Checked by code of the test's own over
random group-shaped datasets and configs."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packfeed.server.index.lengths import index_from_lengths
from packfeed.server.plan.costs import SampleLoads, load_sample_loads, sample_costs
from packfeed.server.plan.plan_file import read_plan
from packfeed.server.plan.planner import count_steps, make_plan
from packfeed.v1.options import Oversize, PlanConfig, Strategy


def grpo_loads(n_groups: int, g: int, seed: int, alone: int = 0, long_responses: bool = False) -> SampleLoads:
    """n_groups prompts answered g times (a prompt's vision units and tokens shared), then `alone` ungrouped
    samples; members of a group are not adjacent in id order."""
    rng = np.random.default_rng(seed)
    vision = np.repeat(rng.integers(0, 6, n_groups), g)
    prefix = np.repeat(rng.integers(20, 300, n_groups), g) + 64 * vision
    responses = np.clip(rng.lognormal(5.5, 1.0, n_groups * g), 10, 4000 if long_responses else 900).astype(np.int64)
    group = np.repeat(np.arange(n_groups), g)
    order = rng.permutation(n_groups * g)
    vision, prefix, responses, group = vision[order], prefix[order], responses[order], group[order]
    extra_vision = rng.integers(0, 4, alone)
    vision = np.concatenate([vision, extra_vision])
    tokens = np.concatenate([prefix + responses, rng.integers(30, 900, alone) + 64 * extra_vision])
    loads = SampleLoads.from_arrays(vision, tokens)
    loads.group = np.concatenate([group, np.full(alone, -1)]).astype(np.int64)
    loads.prefix = np.concatenate([prefix, np.zeros(alone, np.int64)]).astype(np.int32)
    return loads


def packs_of(plan) -> list[np.ndarray]:
    return [plan.members[a:b] for a, b in zip(plan.offsets[:-1], plan.offsets[1:])]


@st.composite
def group_configs(draw):
    strategy = draw(st.sampled_from([Strategy.ISF_BALANCE, Strategy.ISF]))
    stages = draw(st.integers(1, 3))
    return PlanConfig(dp=draw(st.integers(1, 6)), microbatches=draw(st.integers(1, 3)), pipeline_stages=stages,
                      strategy=strategy, oversize=draw(st.sampled_from(list(Oversize))),
                      samples_per_pack=draw(st.sampled_from([1.0, 2.0, 4.0])))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_groups=st.integers(1, 60), g=st.sampled_from([1, 2, 3, 8]), alone=st.integers(0, 40),
       seed=st.integers(0, 2**31), config=group_configs(), long_responses=st.booleans(),
       epoch=st.integers(0, 2))
def test_group_plans_keep_members_together_and_count_each_prefix_once(n_groups, g, alone, seed, config,
                                                                      long_responses, epoch):
    loads = grpo_loads(n_groups, g, seed, alone, long_responses)
    plan = make_plan(loads, config, seed, epoch)
    caps = plan.caps
    members = plan.members.astype(np.int64)
    skipped = set(plan.oversize.tolist()) if config.oversize is Oversize.SKIP else set()
    assert sorted(members.tolist()) == sorted(set(range(len(loads))) - skipped)  # every sample once
    assert count_steps(loads, config, seed, epoch) == plan.n_steps
    assert len(plan.offsets) - 1 == plan.n_steps * config.slots
    np.testing.assert_array_equal(plan.groups, loads.group[members])

    group, prefix, vision, tokens = loads.group, loads.prefix.astype(np.int64), loads.vision, loads.tokens
    over = set(plan.oversize.tolist())
    packs_per_group: dict[int, set[int]] = {}
    for p, pack in enumerate(packs_of(plan)):
        pack = pack.astype(np.int64)
        if len(pack) < 2:
            continue
        # the pack's loads with every prefix once are within the caps (a pack of two or more samples)
        seen: set[int] = set()
        pack_tokens = pack_vision = 0
        for i in pack:
            t = int(tokens[i]) if i not in over or config.oversize is not Oversize.TRUNCATE else min(int(tokens[i]),
                                                                                                    caps.token_cap)
            if group[i] >= 0 and group[i] in seen:
                t -= int(prefix[i])
            else:
                pack_vision += int(vision[i])
            pack_tokens += t
            seen.add(int(group[i])) if group[i] >= 0 else None
        assert pack_tokens <= caps.token_cap and pack_vision <= caps.vision_cap
    for p, pack in enumerate(packs_of(plan)):
        for i in pack:
            if group[i] >= 0 and i not in over:
                packs_per_group.setdefault(int(group[i]), set()).add(p)
    # a group is in one pack when it fits one, else in the fewest packs the test's own bound allows
    for gid, packs in packs_per_group.items():
        ids = np.flatnonzero((group == gid) & ~np.isin(np.arange(len(loads)), list(over)))
        needed = int(prefix[ids[0]]) + int((tokens[ids] - prefix[ids]).sum())
        if loads.towers[ids[0]] and config.collective_safe and len(packs) > 1:
            # cut for collective safety: at most 8 pieces (three halvings), each in as few packs as it needs
            lower = -(-int((tokens[ids] - prefix[ids]).sum()) // (caps.token_cap - int(prefix[ids[0]])))
            assert len(packs) <= min(len(ids), 8 * (2 * lower + 1)), (gid, packs)
        elif needed <= caps.token_cap:
            assert len(packs) == 1, (gid, packs)
        else:  # first-fit-decreasing uses at most twice the lower bound, plus one
            room = caps.token_cap - int(prefix[ids[0]])
            lower = -(-int((tokens[ids] - prefix[ids]).sum()) // room)
            assert lower <= len(packs) <= 2 * lower + 1

    # the summary's savings are the test's own count: each group's prefix once per pack it is in
    summary = plan.summary(loads)["groups"]
    saved_tokens = saved_vision = 0
    for pack in packs_of(plan):
        counts: dict[int, int] = {}
        for i in pack:
            if group[i] >= 0:
                counts[int(group[i])] = counts.get(int(group[i]), 0) + 1
                last = int(i)
                if counts[int(group[i])] > 1:
                    saved_tokens += int(prefix[last])
                    saved_vision += int(vision[last])
    assert summary["prefix_tokens_saved"] == saved_tokens and summary["vision_units_saved"] == saved_vision
    assert summary["groups"] == len(set(group[members][group[members] >= 0].tolist()))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_groups=st.integers(1, 50), g=st.sampled_from([2, 3, 8]), seed=st.integers(0, 2**31),
       dp=st.integers(2, 5), m=st.integers(1, 3))
def test_group_plans_stay_collective_safe(n_groups, g, seed, dp, m):
    assert_collective_safe(grpo_loads(n_groups, g, seed, alone=20), dp, m, seed)


def assert_collective_safe(loads: SampleLoads, dp: int, m: int, seed: int) -> None:
    """The loads' plan at dp x m: within a step and microbatch index the ranks call the image tower all or none,
    but in the leftover columns (fewer than one per class) and the last step, whose packs are split to give every
    rank work; as its summary says; every sample once."""
    plan = make_plan(loads, PlanConfig(dp=dp, microbatches=m), seed, 0)
    calls = np.asarray([int(np.bitwise_or.reduce(loads.towers[p])) if len(p) else 0 for p in packs_of(plan)])
    columns = calls.reshape(-1, dp, m)
    bad = (columns.min(axis=1) == 0) & (columns.max(axis=1) > 0)
    assert bad[:-1].sum() <= 1
    assert int(bad.sum()) == plan.summary(loads)["collective_safe"]["unaligned_microbatches"]
    assert np.array_equal(np.sort(plan.members), np.arange(len(loads)))


def test_shared_plans_cost_the_prefix_once_and_balance_on_it():
    """A unit's LLM cost is that of P + sum(R) tokens whose attention squares are P^2 + sum((P + R)^2 - P^2); the
    shared plan needs fewer steps than the unshared one on a GRPO-shaped mix, and its per-rank cost is balanced."""
    from packfeed.server.plan.groups import group_units
    from packfeed.server.plan.isf import Caps

    loads = grpo_loads(40, 8, 3)
    units = group_units(loads, Caps(64, 1 << 20, 64, 1 << 20))
    costs = sample_costs(PlanConfig().cost_model, units.loads)
    model = PlanConfig().cost_model
    for u in range(len(units.offsets) - 1):
        ids = units.members[units.offsets[u]:units.offsets[u + 1]]
        assert len(set(loads.group[ids].tolist())) == 1 and len(ids) == 8  # no cap: each group whole
        p = float(loads.prefix[ids[0]])
        t = loads.tokens[ids].astype(np.float64)
        expected = model.llm_linear * (p + (t - p).sum()) + model.llm_quadratic * (p * p + (t * t - p * p).sum())
        assert costs[u, 1] == pytest.approx(expected, rel=1e-5)
        assert units.loads.vision[u] == loads.vision[ids[0]]
    shared = make_plan(loads, PlanConfig(dp=4), 0, 0)
    alone = make_plan(loads, PlanConfig(dp=4, shared_prefix=False), 0, 0)
    assert shared.caps == alone.caps  # caps are a memory budget, searched on the samples either way
    assert shared.n_steps < alone.n_steps
    assert alone.config.to_dict()["shared_prefix"] is False and "shared_prefix" not in shared.config.to_dict()

    def rank_costs(plan):  # the test's own cost of each rank's step: every prefix once per pack
        out = []
        for pack in packs_of(plan):
            cost, seen = 0.0, set()
            for i in pack:
                t, p = float(loads.tokens[i]), float(loads.prefix[i])
                if loads.group[i] in seen:
                    cost += model.llm_linear * (t - p) + model.llm_quadratic * (t * t - p * p)
                else:
                    cost += model.llm_linear * t + model.llm_quadratic * t * t + model.vision_linear * float(
                        loads.vit_patches[i]) + model.vision_quadratic * float(loads.vit_attn_sq[i])
                seen.add(loads.group[i])
            out.append(cost)
        return np.asarray(out).reshape(-1, plan.config.dp)[:-1]  # the last step's pieces are whatever is left

    def imbalance(costs):
        return float((costs.max(axis=1) / costs.mean(axis=1)).mean())

    loads = grpo_loads(400, 8, 4)
    balanced = make_plan(loads, PlanConfig(dp=8), 0, 0)
    shuffled = make_plan(loads, PlanConfig(dp=8, strategy="isf"), 0, 0)  # packs to ranks in random order
    assert imbalance(rank_costs(balanced)) < imbalance(rank_costs(shuffled))


def test_plans_refuse_what_sharing_does_not_cover():
    loads = grpo_loads(10, 4, 0)
    for config in (PlanConfig(dp=2, context_parallel=2), PlanConfig(dp=2, strategy="isf+phases")):
        with pytest.raises(ValueError, match="shared_prefix false"):
            make_plan(loads, config, 0, 0)
    make_plan(loads, PlanConfig(dp=2, context_parallel=2, shared_prefix=False), 0, 0)  # the way out works
    padded = make_plan(loads, PlanConfig(dp=2, strategy="random"), 0, 0)  # the baselines batch samples as they come
    assert padded.groups is None


def length_records(n_groups: int, g: int, seed: int, tag: str = "") -> list[dict]:
    rng = np.random.default_rng(seed)
    records = []
    for k in range(n_groups):
        vit = int(rng.integers(0, 5))
        prefix = vit * 256 + int(rng.integers(20, 300))
        label = f"{tag}prompt-{k}" if k % 2 or tag else k
        records += [{"vit_num": vit, "token_num": prefix + int(rng.integers(50, 2000)), "group": label,
                     "prefix_tokens": prefix} for _ in range(g)]
        records.append({"vit_num": 1, "token_num": 400})  # an ungrouped sample between groups
    return records


def test_length_files_with_groups_index_plan_and_write_the_group_column(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(length_records(30, 8, 1)))
    (tmp_path / "b.json").write_text(json.dumps(length_records(5, 3, 2, tag="b-")))
    info = index_from_lengths([tmp_path / "a.json", tmp_path / "b.json"], tmp_path / "i.parquet")
    assert info.groups
    loads, _ = load_sample_loads(tmp_path / "i.parquet")
    assert loads.group[0] == 0 and loads.group[8] == -1 and loads.group[9] == 1 and loads.group[270] == 30
    run = subprocess.run([sys.executable, "-m", "packfeed.cli", "plan", "--index", str(tmp_path / "i.parquet"),
                          "--dp", "8", "--out", str(tmp_path / "plan.parquet")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["groups"]["groups"] == 35 and summary["groups"]["prefix_tokens_saved"] > 0
    assert set(summary["groups"]) >= {"groups", "split_groups", "prefix_tokens_saved", "shared_prefix"}
    plan = read_plan(tmp_path / "plan.parquet")
    np.testing.assert_array_equal(plan.groups, loads.group[plan.members])
    import pyarrow.parquet as pq

    assert "group" in pq.read_table(tmp_path / "plan.parquet").column_names


@pytest.mark.parametrize("record, message", [
    ({"vit_num": 1, "token_num": 300, "group": 1.5, "prefix_tokens": 10}, "string or an integer"),
    ({"vit_num": 1, "token_num": 300, "group": "a"}, "prefix_tokens"),
    ({"vit_num": 1, "token_num": 300, "group": "a", "prefix_tokens": 301}, "prefix_tokens"),
    ({"vit_num": 2, "token_num": 300, "group": "a", "prefix_tokens": 100}, "share one prefix"),
    ({"vit_num": 1, "token_num": 300, "group": "a", "prefix_tokens": 99}, "share one prefix"),
])
def test_length_files_with_bad_groups_are_refused_naming_the_record(tmp_path, record, message):
    good = {"vit_num": 1, "token_num": 200, "group": "a", "prefix_tokens": 100}
    (tmp_path / "l.json").write_text(json.dumps([good, record]))
    with pytest.raises(ValueError, match=message):
        index_from_lengths([tmp_path / "l.json"], tmp_path / "i.parquet")


def test_simulate_and_stats_show_what_sharing_saves(tmp_path):
    """On a GRPO-shaped mix, `packfeed simulate --json` reports the groups with LLM tokens, vision units and step
    and epoch time shared vs each sample alone; `packfeed stats` compares the balanced plan both ways. The saved
    tokens are the test's own count of (members - 1) x prefix over each group in one pack."""
    records = length_records(60, 8, 4)
    (tmp_path / "grpo.json").write_text(json.dumps(records))
    run = subprocess.run([sys.executable, "-m", "packfeed.cli", "simulate", "--lengths",
                          str(tmp_path / "grpo.json"), "--dp", "8", "--microbatches", "2", "--json"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    groups = json.loads(run.stdout)["groups"]
    assert groups["groups"] == 60 and "groups: 60" in run.stderr
    assert groups["llm_tokens_unshared"] == sum(r["token_num"] for r in records)  # each sample alone: every token
    assert groups["llm_tokens_unshared"] - groups["llm_tokens_shared"] == groups["prefix_tokens_saved"] > 0
    assert groups["vision_units_unshared"] - groups["vision_units_shared"] == groups["vision_units_saved"]
    assert groups["epoch_s_shared"] < groups["epoch_s_unshared"] and groups["epoch_speedup"] > 1
    assert groups["steps_shared"] < groups["steps_unshared"]

    index_from_lengths([tmp_path / "grpo.json"], tmp_path / "i.parquet")
    stats = subprocess.run([sys.executable, "-m", "packfeed.cli", "stats", "--index", str(tmp_path / "i.parquet"),
                            "--out", str(tmp_path / "report"), "--dp", "8"], capture_output=True, text=True)
    assert stats.returncode == 0, stats.stderr
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    rows = {row["strategy"]: row for row in report["comparison"]}
    shared, alone = rows["isf+balance"], rows["isf+balance, each sample alone"]
    assert alone["llm_tokens"] - shared["llm_tokens"] == report["groups"]["prefix_tokens_saved"]
    assert shared["steps"] < alone["steps"] and "60 groups share their prefix" in report["groups_note"]
    assert report["groups_note"] in (tmp_path / "report" / "report.md").read_text()


def test_a_windowed_plan_takes_each_group_whole_into_one_window():
    """Windows take samples in the epoch's scattered order; a group goes whole into the window of its lowest id, so
    its members still share their prefix: every sample once, each group (that fits) in one pack."""
    from packfeed.server.plan.windows import WindowedPlan

    loads = grpo_loads(120, 8, 9, alone=50)
    loads.valid[[3, 500]] = False  # invalid members (one may lead its group by id) are left out, never lost
    plan = WindowedPlan(loads, PlanConfig(dp=4, window=200), 0, 0, size=200)
    members, groups_in = [], {}
    step = 0
    while plan.has_step(step):
        for rank in range(4):
            pack = plan.pack_with_truncation(step, rank, 0)[0].tolist()
            members += pack
            for i in pack:
                if loads.group[i] >= 0:
                    groups_in.setdefault(int(loads.group[i]), set()).add((step, rank))
        step += 1
    plan.close()
    assert plan.n_windows > 3
    assert sorted(members) == sorted(np.flatnonzero(loads.valid).tolist())
    caps = plan.caps
    for group, packs in groups_in.items():
        ids = np.flatnonzero((loads.group == group) & loads.valid)
        if int(loads.prefix[ids[0]]) + int((loads.tokens[ids] - loads.prefix[ids]).sum()) <= caps.token_cap:
            assert len(packs) == 1, (group, packs)


def test_a_group_is_cut_for_collective_safety_only_where_that_aligns_the_towers():
    """One image group at DP 2: whole, one rank would call the vision tower and the other not; cut in two, both
    do (each piece with the prompt). With collective_safe off the group stays whole."""
    loads = grpo_loads(1, 4, 0)
    loads.vision[:] = 2
    loads.towers[:] = 1
    safe = make_plan(loads, PlanConfig(dp=2, vision_cap=64, token_cap=1 << 16), 0, 0)
    free = make_plan(loads, PlanConfig(dp=2, vision_cap=64, token_cap=1 << 16, collective_safe=False), 0, 0)
    assert safe.summary(loads)["collective_safe"]["unaligned_microbatches"] == 0
    assert [len(p) for p in packs_of(safe)] == [2, 2]
    assert sorted(len(p) for p in packs_of(free)) == [0, 4]
    assert safe.summary(loads)["groups"]["split_groups"] == 1


def test_groups_are_not_cut_for_the_last_steps_partial_packs():
    """Every sample calls the image tower: only the epoch's last, partial step can leave a rank without it, as
    without groups. Cutting every group for that would give up the epoch's sharing: the collective-safe plan shares
    as much as the plan laid out without collective safety."""
    rng = np.random.default_rng(0)
    vision = np.repeat(rng.integers(1, 7, 400), 8)
    prefix = vision * 256 + np.repeat(rng.integers(30, 300, 400), 8)
    loads = SampleLoads.from_arrays(vision, prefix + np.clip(rng.lognormal(6, 1, 3200), 100, 4096).astype(int))
    loads.group, loads.prefix = np.repeat(np.arange(400), 8), prefix.astype(np.int32)
    safe = make_plan(loads, PlanConfig(dp=8, microbatches=8), 0, 0)
    free = make_plan(loads, PlanConfig(dp=8, microbatches=8, collective_safe=False), 0, 0)
    assert safe.n_steps > 2
    assert safe.summary(loads)["groups"]["prefix_tokens_saved"] == free.summary(loads)["groups"]["prefix_tokens_saved"]
