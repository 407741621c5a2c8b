"""Elastic resume over real gRPC: a job at DP 4 stops after k steps, every rank's state_dict saved; a new job
resumes from them at DP 2 and at DP 8. The ledger over the epoch: every valid sample exactly once (the old
steps before k, then the re-plan), the re-plan the same on two servers, later epochs whole, and a mismatched
or incomplete set of states refused with the reason."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from packfeed.client import LocalServer, PackfeedError, PackStream
from packfeed.server.index.table import read_index

OLD = dict(job="old", dp=4, microbatches=1, epochs=2, seed=3)
STEPS_DONE = 1


def consume(target: str, rank: int, steps: int | None = None, **options) -> tuple[list[str], dict, list]:
    """(sample keys, state_dict, (epoch, step) of each step) after `steps` steps (all when None)."""
    with PackStream(target, rank=rank, **options) as stream:
        keys, positions = [], []
        for step in stream:
            keys += step.sample_keys
            positions.append((step.epoch, step.step))
            if steps is not None and len(positions) == steps:
                break
        return keys, stream.state_dict(), positions


def run_ranks(target: str, steps: int | None = None, **options) -> list[tuple[list[str], dict, list]]:
    with ThreadPoolExecutor(options["dp"]) as pool:
        return list(pool.map(lambda rank: consume(target, rank, steps, **options), range(options["dp"])))


@pytest.fixture(scope="module")
def old_job(small_tile_index):
    """The old job's first STEPS_DONE steps on every rank: (keys consumed, the four state_dicts)."""
    with LocalServer(small_tile_index, workers=1) as server:
        ranks = run_ranks(server.target, STEPS_DONE, **OLD)
    return [key for keys, _, _ in ranks for key in keys], [state for _, state, _ in ranks]


def epoch_records(target: str, rank: int, **options) -> list[tuple[int, int, list[str]]]:
    """(epoch, step, sample keys) of every step the rank gets."""
    with PackStream(target, rank=rank, **options) as stream:
        return [(step.epoch, step.step, list(step.sample_keys)) for step in stream]


def opened(target: str, **options):
    """The JobInfo a stream gets on opening its job (the stream closed again)."""
    with PackStream(target, rank=0, **options) as stream:
        return stream.info


@pytest.mark.parametrize("dp", [2, 8])
def test_resuming_at_another_dp_delivers_the_epoch_exactly_once(small_tile_index, old_job, dp):
    consumed, states = old_job
    valid = Counter(r["key"] for r in read_index(small_tile_index, ["key", "valid"])[0].to_pylist() if r["valid"])
    new = dict(job=f"new-{dp}", dp=dp, microbatches=2, epochs=2, seed=3, resume=states)
    per_epoch = {0: Counter(consumed), 1: Counter()}
    with LocalServer(small_tile_index, workers=1) as server, LocalServer(small_tile_index, workers=1) as other:
        with ThreadPoolExecutor(dp) as pool:
            ranks = list(pool.map(lambda rank: epoch_records(server.target, rank, **new), range(dp)))
        infos = [opened(target, **new) for target in (server.target, other.target)]
    for records in ranks:
        assert records[0][:2] == (0, 0)  # the resumed epoch, its steps counted from 0
        for epoch, _, keys in records:
            per_epoch[epoch].update(keys)
    assert per_epoch[0] == valid  # 0 lost, 0 repeated: the old job's first steps, then the re-plan
    assert per_epoch[1] == valid  # the next epoch, planned whole at the new DP
    assert infos[0].plan_fingerprint == infos[1].plan_fingerprint  # the same re-plan on two servers
    assert infos[0].resume.step == STEPS_DONE and infos[0].resume.plan.dp == 4 and infos[0].plan.dp == dp


def test_mismatched_or_incomplete_states_are_refused(small_tile_index, old_job):
    _, states = old_job
    new = dict(job="refused", dp=2, microbatches=1, epochs=2, seed=3)
    with LocalServer(small_tile_index, workers=1) as server:
        with pytest.raises(PackfeedError, match=r"missing \[3\]"):
            PackStream(server.target, rank=0, resume=states[:3], **new)
        behind = [dict(states[0], next=[0, STEPS_DONE - 1])] + states[1:]
        with pytest.raises(PackfeedError, match="stopped at different steps"):
            PackStream(server.target, rank=0, resume=behind, **new)
        with pytest.raises(PackfeedError, match="seed 3, this one asks for 4"):
            PackStream(server.target, rank=0, resume=states, **{**new, "seed": 4})
        with pytest.raises(PackfeedError, match="an id of its own"):
            PackStream(server.target, rank=0, resume=states, **{**new, "job": "old"})
        beyond = [dict(state, next=[0, 10_000]) for state in states]
        with pytest.raises(PackfeedError, match="cannot have consumed 10000"):
            PackStream(server.target, rank=0, resume=beyond, **new)


@pytest.mark.parametrize("steps", [0, 7, 40])
def test_the_re_plan_covers_what_the_old_plan_left_exactly_once(steps):
    """At the planner: 20,000 samples planned at DP 4 x M 2; after `steps` steps the rest re-planned at DP 8 x
    M 3: together every valid sample once, and the same re-plan computed twice."""
    import numpy as np

    from packfeed.server.plan.costs import SampleLoads
    from packfeed.server.plan.planner import make_plan
    from packfeed.server.plan.resume import consumed_samples, resume_plan
    from packfeed.v1.options import PlanConfig

    rng = np.random.default_rng(steps)
    loads = SampleLoads.from_arrays(rng.integers(0, 13, 20_000), rng.integers(64, 4096, 20_000),
                                    rng.random(20_000) > 0.02)
    old = make_plan(loads, PlanConfig(dp=4, microbatches=2), seed=1, epoch=0)
    new_config = PlanConfig(dp=8, microbatches=3)
    resumed = resume_plan(loads, old, steps, new_config, seed=1, epoch=0)
    again = resume_plan(loads, old, steps, new_config, seed=1, epoch=0)
    together = np.concatenate([consumed_samples(old, steps), resumed.members])
    assert np.array_equal(np.sort(together), np.flatnonzero(loads.valid))
    assert np.array_equal(resumed.members, again.members) and resumed.fingerprint() == again.fingerprint()
    assert resumed.config.dp == 8 and resumed.n_steps > 0


def test_a_windowed_old_plan_is_resumed_exactly_once():
    import numpy as np

    from packfeed.server.plan.costs import SampleLoads
    from packfeed.server.plan.resume import consumed_samples, resume_plan
    from packfeed.server.plan.windows import WindowedPlan
    from packfeed.v1.options import PlanConfig

    rng = np.random.default_rng(9)
    loads = SampleLoads.from_arrays(rng.integers(0, 13, 9_000), rng.integers(64, 4096, 9_000), rng.random(9_000) > 0.02)
    old = WindowedPlan(loads, PlanConfig(dp=4, microbatches=2, window=2_000), seed=2, epoch=1, size=2_000)
    steps = old.n_steps // 2  # well into the third window
    resumed = resume_plan(loads, old, steps, PlanConfig(dp=2, microbatches=4), seed=2, epoch=1)
    together = np.concatenate([consumed_samples(old, steps), resumed.members])
    assert np.array_equal(np.sort(together), np.flatnonzero(loads.valid))


def test_a_mixture_job_resumes_at_another_dp_with_the_same_rows(tmp_path, demo_dataset):
    """A mixture's epoch resumed: each sample its repeat count over the epoch, the fractional dataset's subset
    the one the old job drew."""
    from test_mixture import served_mixture

    mix = served_mixture(tmp_path, demo_dataset)
    # padded batches of 2: short text samples would all fit one ISF step
    old = dict(job="mix-old", dataset="sft-mix", dp=2, microbatches=1, epochs=1, seed=5, strategy="random",
               samples_per_pack=2)
    with LocalServer(None, workers=1, extra_args=["--mixture", str(mix)]) as server:
        ranks = run_ranks(server.target, 1, **old)
        consumed = Counter(key for keys, _, _ in ranks for key in keys)
        states = [state for _, state, _ in ranks]
        assert all(state["next"] == [0, 1] for state in states), states  # stopped mid-epoch
        new = dict(old, job="mix-new", dp=1, microbatches=2, resume=states)
        rest = Counter(key for _, _, keys in epoch_records(server.target, 0, **new) for key in keys)
        straight = Counter(key for rank in range(2) for _, _, keys in epoch_records(server.target, rank, **{
            **old, "job": "mix-straight"}) for key in keys)
    assert consumed + rest == straight  # the same rows, repeats and subset: only the topology changed
    assert all(straight[f"charts-{i}"] == 2 for i in range(12))


def test_a_resume_of_another_job_than_it_claims_is_refused(tmp_path, small_tile_index, old_job):
    """The states name their plan; the server re-computes it from them and refuses a resume over an index that
    lost a shard (same dataset name), or from states whose M, DP or seed was edited, naming both plans and what
    differs. The honest states still resume (the exact ledger is the test above)."""
    from conftest import SMALL_TILE_POLICY

    from packfeed.server.index.config import IndexConfig
    from packfeed.server.index.indexer import build_index
    from packfeed.server.index.table import read_index_info

    _, states = old_job
    shrunk = tmp_path / "index.parquet"  # the same shards but the last one, as the fixture indexed them
    config = IndexConfig(tokenizer=str(small_tile_index.parent / "tokenizer.json"), image_policy=SMALL_TILE_POLICY)
    build_index(read_index_info(small_tile_index).inputs[:-1], shrunk, config, workers=1, progress=False)
    new = dict(job="checked", dp=2, microbatches=1, epochs=2, seed=3)
    with LocalServer(shrunk, workers=1) as server:
        with pytest.raises(PackfeedError, match="FAILED_PRECONDITION") as refused:
            PackStream(server.target, rank=0, resume=states, **new)
    message = str(refused.value)
    assert states[0]["plan_fingerprint"] in message and "what differs: the index" in message
    assert states[0]["index_fingerprint"] in message and read_index_info(shrunk).fingerprint in message
    edited = {
        "M 1 -> 5": [dict(s, plan=dict(s["plan"], microbatches=5)) for s in states],
        "DP 4 -> 3": [dict(s, plan=dict(s["plan"], dp=3)) for s in states[:3]],
        "seed 3 -> 4": [dict(s, seed=4) for s in states],
    }
    with LocalServer(small_tile_index, workers=1) as server:
        for name, forged in edited.items():
            with pytest.raises(PackfeedError, match="FAILED_PRECONDITION") as refused:
                PackStream(server.target, rank=0, resume=forged, **dict(new, seed=forged[0]["seed"]))
            assert "plan settings or seed" in str(refused.value) and states[0]["plan_fingerprint"] in str(refused.value), name
        with PackStream(server.target, rank=0, resume=states, **new) as honest:
            assert honest.info.resume.plan_fingerprint == states[0]["plan_fingerprint"]


def test_forged_states_are_refused_in_the_client_before_any_allocation(old_job):
    """Every field is bounded: a dp of 2^32-1 (as a list(range(dp)) would take 100+ GiB), a negative or huge
    position, a rank past the plan, a non-dict: each a PackfeedError naming the field, within milliseconds."""
    import time

    from packfeed.client.stream.resume import resume_from

    _, states = old_job
    forged = {
        "dp": [dict(s, plan=dict(s["plan"], dp=2**32 - 1)) for s in states],
        "next[1]": [dict(s, next=[0, -1]) for s in states],
        "next[0]": [dict(s, next=[10**9, 0]) for s in states],
        "rank": [dict(states[0], rank=2**40)] + states[1:],
        "seed": [dict(s, seed="3") for s in states],
        "plan_fingerprint": [dict(s, plan_fingerprint="") for s in states],
        "a list": [list(states[0].items())] + states[1:],
        "previous": [dict(s, resumed={"plan": s["plan"]}) for s in states],
    }
    for name, bad in forged.items():
        started = time.monotonic()
        with pytest.raises(PackfeedError) as refused:
            resume_from(bad, "new", 3 if name != "seed" else "3")
        assert time.monotonic() - started < 5, name  # checked, not planned: a forged dp of 2^32 would take hours
        assert name.split("[")[0] in str(refused.value) or name in ("a list", "previous"), (name, str(refused.value))
    assert resume_from(states, "new", 3).plan_fingerprint == states[0]["plan_fingerprint"]


def test_a_resumed_job_resumed_again_delivers_the_epoch_exactly_once(small_tile_index, old_job):
    """A chain: DP 4 stops after a step, DP 2 resumes and stops after another, DP 3 resumes that. The second
    resume re-computes the first one's plan (its states record what it resumed), so the epoch is still whole."""
    consumed, states = old_job
    valid = Counter(r["key"] for r in read_index(small_tile_index, ["key", "valid"])[0].to_pylist() if r["valid"])
    middle = dict(job="middle", dp=2, microbatches=1, epochs=1, seed=3, resume=states)
    last = dict(job="last", dp=3, microbatches=1, epochs=1, seed=3)
    with LocalServer(small_tile_index, workers=1) as server:
        ranks = run_ranks(server.target, 1, **middle)
        middle_states = [state for _, state, _ in ranks]
        assert middle_states[0]["resumed"]["plan_fingerprint"] == states[0]["plan_fingerprint"]
        with ThreadPoolExecutor(3) as pool:
            rest = list(pool.map(lambda rank: epoch_records(server.target, rank, **last, resume=middle_states),
                                 range(3)))
    delivered = Counter(consumed) + Counter(key for keys, _, _ in ranks for key in keys)
    delivered += Counter(key for records in rest for _, _, keys in records for key in keys)
    assert delivered == valid
