"""Context-parallel plans: property tests of their guarantees (every sample once, no GPU above N tokens, packs on
aligned lanes that never overlap, only the last step with free lanes, determinism), the contract's zigzag split,
and `packfeed plan --context-parallel`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packfeed.server.plan.context_parallel import max_tokens_per_gpu, subpacks
from packfeed.server.plan.costs import SampleLoads
from packfeed.server.plan.plan_file import read_plan
from packfeed.server.plan.planner import count_steps, make_plan
from packfeed.v1.context_parallel import pack_shares, rank_chunks, zigzag_chunks
from packfeed.v1.options import CpMode, Oversize, PlanConfig


@st.composite
def long_mixes(draw):
    """Short image samples and a few long videos (some beyond what C GPUs hold at the N drawn below)."""
    n = draw(st.integers(0, 200))
    long = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    tokens = [draw(st.integers(2000, 40000)) if is_long else draw(st.integers(1, 900)) for is_long in long]
    vision = [draw(st.integers(4, 40)) if is_long else draw(st.integers(0, 6)) for is_long in long]
    valid = draw(st.lists(st.sampled_from([True, True, True, False]), min_size=n, max_size=n))
    return SampleLoads.from_arrays(vision, tokens, valid)


@st.composite
def cp_configs(draw):
    return PlanConfig(dp=draw(st.integers(1, 4)), microbatches=draw(st.integers(1, 3)),
                      context_parallel=draw(st.sampled_from([2, 4, 8])),
                      max_tokens_per_gpu=draw(st.sampled_from([1024, 3000, 4096])),
                      cp_mode=draw(st.sampled_from(list(CpMode))), oversize=draw(st.sampled_from(list(Oversize))),
                      vision_cap=12, token_cap=2048)


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(loads=long_mixes(), config=cp_configs(), seed=st.integers(0, 2**31), safe=st.booleans())
def test_a_counted_cp_epoch_has_its_plans_steps(loads, config, seed, safe):
    """Dynamic CP counts its steps by splitting and sizing its packs as the plan does, without placing them."""
    config = replace(config, collective_safe=safe)
    assert count_steps(loads, config, seed, 3) == make_plan(loads, config, seed, 3).n_steps


def gpu_tokens(plan, loads) -> tuple[np.ndarray, np.ndarray]:
    """Per pack of the plan: the most tokens any of its GPUs holds under the contract's split, and whether it
    holds an oversize sample."""
    slot, starts, stops = subpacks(plan.offsets, plan.cp_degree, plan.cp_group)
    peak, oversize = [], []
    for a, b in zip(starts, stops):
        ids, cut = plan.members[a:b], plan.truncate_to[a:b]
        lengths = [int(min(t, c) if c else t) for t, c in zip(loads.tokens[ids], cut)]
        d = int(plan.cp_degree[a])
        shares = pack_shares(lengths, d)
        peak.append(max(sum(stop - start for chunks in shares for start, stop in rank_chunks(chunks, j))
                        for j in range(d)))
        oversize.append(bool(np.isin(ids, plan.oversize).any()))
    return np.array(peak, dtype=np.int64), np.array(oversize, dtype=bool)


@SETTINGS
@given(loads=long_mixes(), config=cp_configs(), seed=st.integers(0, 2**31))
def test_every_sample_once_and_no_gpu_above_n_tokens(loads, config, seed):
    plan = make_plan(loads, config, seed, 0)
    expected = np.flatnonzero(loads.valid)
    if config.oversize is Oversize.SKIP:
        expected = np.setdiff1d(expected, plan.oversize)
    assert np.array_equal(np.sort(plan.members), expected)
    n = max_tokens_per_gpu(plan)
    assert n == (config.max_tokens_per_gpu or 2048)
    peak, oversize = gpu_tokens(plan, loads)
    assert (peak[~oversize] <= n).all(), "a GPU holds more than N tokens of samples that fit"
    if config.oversize is Oversize.TRUNCATE:  # cut to C x N: within N again, unless too many vision units
        cut = np.isin(plan.members, plan.oversize) & (plan.truncate_to > 0)
        assert (plan.truncate_to[cut] == n * config.context_parallel).all()
    # every oversize sample is reported, and none goes unreported
    too_long = np.flatnonzero(loads.valid & (loads.tokens > n * config.context_parallel))
    assert set(too_long.tolist()) <= set(plan.oversize.tolist())


@SETTINGS
@given(loads=long_mixes(), config=cp_configs(), seed=st.integers(0, 2**31))
def test_packs_sit_on_aligned_lanes_that_never_overlap_and_only_the_last_step_has_free_lanes(loads, config, seed):
    plan = make_plan(loads, config, seed, 0)
    c = config.context_parallel
    assert plan.n_packs == plan.n_steps * config.slots
    slot, starts, _ = subpacks(plan.offsets, plan.cp_degree, plan.cp_group)
    degree, group = plan.cp_degree[starts], plan.cp_group[starts]
    assert set(np.unique(degree).tolist()) <= {1, 2, 4, 8} and (degree <= c).all()
    if config.cp_mode is CpMode.STATIC:
        assert (degree == c).all() and (group == 0).all()
    lanes = Counter((int(s), lane) for s, d, g in zip(slot, degree, group) for lane in range(g * d, (g + 1) * d))
    assert all(count == 1 for count in lanes.values()), "two packs share a GPU in one microbatch"
    assert all(lane < c for _, lane in lanes)
    # each slot's packs are in the order of their first lanes
    first_lane = plan.cp_group * plan.cp_degree
    for s in range(plan.n_packs):
        assert (np.diff(first_lane[plan.offsets[s]:plan.offsets[s + 1]]) >= 0).all()
    if config.cp_mode is CpMode.DYNAMIC and plan.n_steps:
        used = np.bincount(slot // config.slots, weights=degree, minlength=plan.n_steps)
        assert (used[:-1] == config.slots * c).all(), "a step before the last has free lanes"


@SETTINGS
@given(loads=long_mixes(), config=cp_configs(), seed=st.integers(0, 2**31))
def test_same_inputs_same_plan(loads, config, seed):
    a, b = make_plan(loads, config, seed, 3), make_plan(loads, config, seed, 3)
    assert a.fingerprint() == b.fingerprint()
    assert np.array_equal(a.cp_degree, b.cp_degree) and np.array_equal(a.cp_group, b.cp_group)


def video_mix(n: int = 3000, seed: int = 0) -> SampleLoads:
    rng = np.random.default_rng(seed)
    tokens, vision = rng.integers(200, 3000, n), rng.integers(0, 8, n)
    video = rng.random(n) < 0.03
    tokens[video], vision[video] = rng.integers(8000, 130000, video.sum()), rng.integers(16, 200, video.sum())
    return SampleLoads.from_arrays(vision, tokens)


def test_dynamic_degrees_follow_sample_length_and_balance_every_gpu_better_than_static():
    loads = video_mix()
    dynamic = make_plan(loads, PlanConfig(dp=4, context_parallel=4, max_tokens_per_gpu=32768), 0, 0)
    static = make_plan(loads, PlanConfig(dp=4, context_parallel=4, max_tokens_per_gpu=32768, cp_mode="static"), 0, 0)
    members_degree = dict(zip(dynamic.members.tolist(), dynamic.cp_degree.tolist()))
    longest = int(np.argmax(loads.tokens))
    assert members_degree[longest] == min(4, 1 << int(np.ceil(np.log2(loads.tokens[longest] / 32768))))
    d, s = dynamic.summary(loads)["context_parallel"], static.summary(loads)["context_parallel"]
    assert set(d["degrees"]) == {"1", "2", "4"} and s["degrees"] == {"4": static.n_packs}
    assert d["gpu_dist"] < s["gpu_dist"] / 2
    assert d["peak_tokens_per_gpu"] <= 32768 and d["packs_over_max_tokens"] == 0


@SETTINGS
@given(loads=long_mixes(), config=cp_configs(), seed=st.integers(0, 2**31))
def test_a_long_samples_pack_is_topped_up_with_samples_one_gpu_holds(loads, config, seed):
    """Dynamic CP: a pack at degree d > 1 starts with a sample that needs d GPUs; the rest are samples one GPU
    holds, within what its d GPUs hold (d x N tokens)."""
    if config.cp_mode is CpMode.STATIC:
        return
    plan = make_plan(loads, replace(config, collective_safe=False), seed, 0)  # collective-safe plans widen packs
    n, c = max_tokens_per_gpu(plan), config.context_parallel
    _, starts, stops = subpacks(plan.offsets, plan.cp_degree, plan.cp_group)
    for a, b in zip(starts, stops):
        d, ids = int(plan.cp_degree[a]), plan.members[a:b]
        tokens = loads.tokens[ids]
        if d == 1 or ids[0] in plan.oversize:
            continue
        assert n * d // 2 < tokens[0], "a pack spread wider than its first sample needs"
        assert (tokens[1:] <= n).all() and tokens.sum() <= n * d
        assert loads.vision[ids[1:]].sum() <= plan.caps.vision_cap * d


def test_topping_up_uses_the_gpus_as_fully_as_static_cp():
    """Without topping up, a 40K-token video at degree 2 leaves its GPUs a quarter empty; with it dynamic CP needs
    no more steps than static CP and balances every GPU far better."""
    loads = video_mix()
    for dp, c in ((4, 4), (2, 8)):
        dynamic = make_plan(loads, PlanConfig(dp=dp, context_parallel=c, max_tokens_per_gpu=32768), 0, 0)
        static = make_plan(loads, PlanConfig(dp=dp, context_parallel=c, max_tokens_per_gpu=32768,
                                             cp_mode="static"), 0, 0)
        _, starts, stops = subpacks(dynamic.offsets, dynamic.cp_degree, dynamic.cp_group)
        assert any(b - a > 1 for a, b in zip(starts, stops) if dynamic.cp_degree[a] > 1), "no long pack topped up"
        assert dynamic.n_steps <= static.n_steps + 1


def test_another_seed_gives_another_plan():
    loads = video_mix(600)
    config = PlanConfig(dp=2, context_parallel=4, max_tokens_per_gpu=16384)
    assert make_plan(loads, config, 0, 0).fingerprint() != make_plan(loads, config, 1, 0).fingerprint()


def test_plan_file_carries_cp_and_cp_group_and_round_trips(tmp_path):
    loads = video_mix(600)
    plan = make_plan(loads, PlanConfig(dp=2, microbatches=2, context_parallel=4, max_tokens_per_gpu=16384), 0, 0)
    plan.write(tmp_path / "plan.parquet")
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "plan.parquet")
    rows = ~table.column("empty").to_numpy(zero_copy_only=False)
    assert np.array_equal(table.column("cp").to_numpy()[rows], plan.cp_degree)
    assert np.array_equal(table.column("cp_group").to_numpy()[rows], plan.cp_group)
    again = read_plan(tmp_path / "plan.parquet")
    assert again.fingerprint() == plan.fingerprint()
    assert np.array_equal(again.pack_cp(0, 1, 1)[0], plan.pack_cp(0, 1, 1)[0])


def test_a_plan_file_whose_cp_columns_do_not_fit_its_settings_is_refused(tmp_path):
    """A 4-GPU CP plan read under settings of 2 GPUs (or with a degree or cp_group outside C) would run its
    packs on GPUs that do not exist: the file is refused where it is read, naming the row."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from packfeed.server.plan.plan_file import PLAN_METADATA_KEY

    plan = make_plan(video_mix(600), PlanConfig(dp=2, microbatches=2, context_parallel=4, max_tokens_per_gpu=16384),
                     0, 0)
    assert (plan.cp_degree == 4).any()
    plan.write(tmp_path / "plan.parquet")
    table = pq.read_table(tmp_path / "plan.parquet")
    meta = json.loads(table.schema.metadata[PLAN_METADATA_KEY])

    def tampered(name: str, config=None, column=None, values=None) -> str:
        changed = {**meta, "config": {**meta["config"], **(config or {})}}
        edited = table.replace_schema_metadata({**table.schema.metadata, PLAN_METADATA_KEY: json.dumps(changed)})
        if column:
            edited = edited.set_column(edited.column_names.index(column), column, pa.array(values, pa.int32()))
        pq.write_table(edited, tmp_path / name)
        return str(tmp_path / name)

    rows = len(table)
    for path, message in ((tampered("two.parquet", {"context_parallel": 2}),
                           "row .* not a pack on the plan's context_parallel 2 GPUs"),
                          (tampered("degree.parquet", column="cp", values=[3] * rows), "has cp 3"),
                          (tampered("group.parquet", column="cp_group", values=[4] * rows), "cp_group 4"),
                          (tampered("none.parquet", {"context_parallel": 1, "max_tokens_per_gpu": None,
                                                     "cp_mode": "dynamic"}), "context_parallel 1")):
        with pytest.raises(ValueError, match=message):
            read_plan(path)
    assert read_plan(tmp_path / "plan.parquet").fingerprint() == plan.fingerprint()


def test_zigzag_chunks_cover_every_sample_once_and_balance_each_pack():
    rng = np.random.default_rng(0)
    for _ in range(500):
        d = int(rng.choice([1, 2, 4, 8]))
        lengths = rng.integers(0, 200, rng.integers(1, 8)).tolist()
        shares = pack_shares(lengths, d)
        for chunks, length in zip(shares, lengths):
            assert len(chunks) == 2 * d and chunks[0][0] == 0 and chunks[-1][1] == length
            assert all(chunks[k][1] == chunks[k + 1][0] for k in range(2 * d - 1))
        held = [sum(b - a for chunks in shares for a, b in rank_chunks(chunks, j)) for j in range(d)]
        assert max(held) == -(-sum(lengths) // d) and sum(held) == sum(lengths)
    # the zigzag pairs an early chunk with a late one: rank 0 holds the first and the last
    assert rank_chunks(zigzag_chunks(16, 2)[0], 0) == [(0, 4), (12, 16)]
    with pytest.raises(ValueError, match="degree"):
        zigzag_chunks(10, 0)


def test_config_errors_name_the_field():
    for bad, message in (({"context_parallel": 3}, "power of 2"), ({"max_tokens_per_gpu": 100}, "apply with"),
                         ({"context_parallel": 2, "strategy": "random"}, "isf"),
                         ({"context_parallel": 2, "window": 100}, "window"),
                         ({"context_parallel": 2, "cp_mode": "zigzag"}, "cp_mode")):
        with pytest.raises(ValueError, match=message):
            PlanConfig(dp=2, **bad)


def test_plan_command_prints_degrees_peak_and_gpu_dist(tmp_path, dataset):
    out = subprocess.run([sys.executable, "-m", "packfeed.cli", "plan", "--index", str(dataset), "--dp", "2",
                          "--context-parallel", "4", "--max-tokens-per-gpu", "256", "--out",
                          str(tmp_path / "plan.parquet")], capture_output=True, text=True, check=True)
    summary = json.loads(out.stdout)["context_parallel"]
    alignment = json.loads(out.stdout)["collective_safe"]  # laid out over every GPU of DP x CP
    assert alignment["on"] and "off_because" not in alignment
    assert alignment["unaligned_microbatches"] == 0 or "ensure_encoders" in out.stderr
    assert summary["max_tokens_per_gpu"] == 256 and summary["groups"] == 4 and summary["gpus"] == 8
    assert sum(summary["degrees"].values()) > 0 and 0 <= summary["gpu_dist"] < 1
    assert summary["peak_tokens_per_gpu"] <= 256 or summary["packs_over_max_tokens"] > 0
    assert read_plan(tmp_path / "plan.parquet").cp_degree is not None


def test_the_contracts_degree_rule_is_the_planners():
    """`packfeed.v1.context_parallel.degree_for` (what the simulator's bound and a client may compute) gives a
    sample the degree the planner gives it."""
    from packfeed.server.plan.context_parallel import degrees
    from packfeed.v1.context_parallel import degree_for

    tokens = np.random.default_rng(0).integers(1, 300_000, 2000)
    for n in (1024, 4096, 40960):
        assert [degree_for(int(t), n) for t in tokens] == degrees(tokens, n).tolist()
