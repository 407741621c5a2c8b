"""Asynchronous RL on real servers (docs/live.md "Asynchronous RL"): an asynchronous GRPO run on CPU, two trainer
ranks (torchrun, gloo) training a tiny causal LM on a live job under staleness wait, each version's weights
published to a folder, and producer processes generating with the newest weights they find there (HF
`generate`), each group reserved first (tests/async_rl_worker.py). One producer is killed (SIGKILL) halfway
through a rollout: another claims it, finishes it with newer weights, and it is trained once, its group whole.

And: a job whose producers are all killed tells its trainers' streams, within producer_timeout_s, naming the job
and its producers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from forked_torchrun import torchrun

from packfeed.client import LocalServer, PackStream, PlanConfig, Producer, ProducersGone
from packfeed.client.stream.channel import Connection
from packfeed.v1 import packfeed_pb2 as pb

WORKER = Path(__file__).resolve().parent / "async_rl_worker.py"
CONNECTION = Connection(token="", retries=8, backoff=0.2)


def run_producer(target: str, job: str, weights: Path, out: Path, name: str, groups: int, *extra: str):
    return subprocess.Popen([sys.executable, str(WORKER), "producer", target, job, str(weights), str(out), name,
                             str(groups), *extra], env={**os.environ, "PACKFEED_AUTH_TOKEN": ""},
                            stdout=open(out / f"{name}.log", "wb"), stderr=subprocess.STDOUT)


def _get(target: str, job: str) -> pb.LiveStatus:
    from packfeed.client.stream.channel import ServerChannel

    channel = ServerChannel([target], CONNECTION)
    try:
        return channel.call("GetJob", pb.GetJobRequest(job=job)).live
    finally:
        channel.close()


def _wait(process: subprocess.Popen, deadline: float, target: str, out: Path) -> int:
    try:
        return process.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise AssertionError(_stalled(f"producer {process.args[7]}", target, out)) from None


def _stalled(what: str, target: str, out: Path) -> str:
    """What a stalled run was waiting for: the job's status, the producers' and trainers' log tails."""
    logs = {path.name: path.read_text(errors="replace")[-1500:] for path in sorted(out.rglob("*.log"))}
    return f"{what} did not finish; the job: {_get(target, 'async')}; logs: {json.dumps(logs, indent=1)}"


@pytest.mark.slow
def test_asynchronous_grpo_trains_every_sample_once_within_its_staleness(small_tile_index, tmp_path):
    sys.path.insert(0, str(WORKER.parent))
    from async_rl_worker import model, publish

    weights, out = tmp_path / "weights", tmp_path / "out"
    weights.mkdir()
    out.mkdir()
    publish(weights, model(), 0)
    with LocalServer(small_tile_index, workers=1, extra_args=["--live-spool", str(tmp_path / "spool")]) as server:
        trainers = threading.Thread(target=torchrun, args=(WORKER, ["trainer", server.target, "async", weights, out],
                                                           out / "logs"), daemon=True)
        trainers.start()
        deadline = time.monotonic() + 480  # inside pytest's 600 s, so that a run that stalls says where
        killer = run_producer(server.target, "async", weights, out, "killer", 0, "kill")
        assert _wait(killer, deadline, server.target, out) == -signal.SIGKILL  # killed mid-rollout, partial put
        producers = {name: run_producer(server.target, "async", weights, out, name, groups)
                     for name, groups in (("steady", 5), ("claimer", 4))}
        for name, producer in producers.items():
            assert _wait(producer, deadline, server.target, out) == 0, (out / f"{name}.log").read_text()[-2000:]
        status = _get(server.target, "async")
        with Producer(server.target, job="async", connection=CONNECTION, heartbeat_s=0) as ender:
            ender.end()  # what is pending forms the last step
        trainers.join(max(1.0, deadline - time.monotonic()))
        assert not trainers.is_alive(), _stalled("the trainers", server.target, out)
        final = _get(server.target, "async")
    put = [group for name in ("killer", "steady", "claimer")
           for group in json.loads((out / f"producer-{name}.json").read_text())["groups"]]
    continued = [c for name in ("steady", "claimer")
                 for c in json.loads((out / f"producer-{name}.json").read_text())["continued"]]
    trained = {}
    for rank in range(2):
        record = json.loads((out / f"trainer-r{rank}.json").read_text())
        assert record["outcome"] == "ended"
        for step in record["steps"]:
            for key, group, version, token_versions in step["samples"]:
                assert key not in trained, f"{key} trained twice"
                trained[key] = (group, version, token_versions, step["trained_by"])
    uniform = [g for g in put if None not in g["rewards"] and len(set(g["rewards"])) == 1]
    expected = {key for g in put if g not in uniform for key in g["ids"]}
    assert set(trained) == expected  # every acknowledged sample once; filter_groups dropped exactly the uniform
    assert final.groups_filtered == len(uniform) and final.dropped_stale == 0 and final.trained_stale == 0
    assert all(trained_by - version <= 1 for _, version, _, trained_by in trained.values())  # within staleness
    assert status.producers and {p.name for p in status.producers} >= {"steady", "claimer"}
    # the rollout the killed producer left half done: claimed, finished with newer weights, trained once
    assert [c["id"] for c in continued] == ["long-3"]
    group, version, token_versions, _ = trained["long-3"]
    first, later = continued[0]["from_version"], continued[0]["with_version"]
    assert later > first and version == later
    assert token_versions == sorted(token_versions) and set(token_versions) == {first, later}


def test_a_stream_whose_producers_all_died_is_told_within_the_timeout_naming_them(small_tile_index, tmp_path):
    plan = PlanConfig(dp=2, microbatches=1, live=True, step_samples=64, producer_timeout_s=6)
    with LocalServer(small_tile_index, workers=1, extra_args=["--live-spool", str(tmp_path / "spool")]) as server:
        failures: dict[int, tuple[float, BaseException]] = {}

        def train(rank: int) -> None:
            stream = PackStream(server.target, job="gone", rank=rank, plan=plan, connection=CONNECTION)
            try:
                for _ in stream:
                    pass
            except Exception as error:  # noqa: BLE001 - the test reads it
                failures[rank] = (time.monotonic(), error)
            finally:
                stream.close()

        ranks = [threading.Thread(target=train, args=(rank,), daemon=True) for rank in range(2)]
        for thread in ranks:
            thread.start()
        script = ("import sys, time; from packfeed.client import Producer; "
                  "p = Producer(sys.argv[1], job='gone', name=sys.argv[2], heartbeat_s=1, open_wait_s=60); "
                  "p.put([{'id': sys.argv[2] + str(i), 'tokens': [300 + i] * 8} for i in range(2)]); "
                  "print('put', flush=True); time.sleep(600)")
        producers = [subprocess.Popen([sys.executable, "-c", script, server.target, name], stdout=subprocess.PIPE,
                                      env={**os.environ, "PACKFEED_AUTH_TOKEN": ""}) for name in ("gen-a", "gen-b")]
        for producer in producers:
            assert producer.stdout.readline().strip() == b"put"  # its samples are durable
        killed = time.monotonic()
        for producer in producers:
            producer.send_signal(signal.SIGKILL)
            producer.wait(30)
        for thread in ranks:
            thread.join(60)
        status = _get(server.target, "gone")
    assert sorted(failures) == [0, 1]
    for when, error in failures.values():
        assert isinstance(error, ProducersGone) and error.job == "gone"
        assert "job 'gone'" in str(error) and "producer_timeout_s 6" in str(error)
        assert "(gen-a)" in str(error) and "(gen-b)" in str(error)
        assert when - killed <= 6 + 20  # the timeout counts from the last put, before the kill
    assert status.arrived == 4 and status.producers_alive == 0 and "producer_timeout_s" in status.producers_gone


def test_an_unfinished_rollout_outlives_a_kill_9_of_its_server(small_tile_index, tmp_path):
    """A rollout put unfinished and claimed, then its server killed -9: a server on the same spool has it in its
    pool again (a claim is a server's memory, the part is the spool's), another producer finishes it, it is trained
    once with each token's version, and the first claimant's late continuation is refused, never trained twice."""
    plan = PlanConfig(dp=1, microbatches=1, live=True, step_samples=2)
    spool = ["--live-spool", str(tmp_path / "spool")]
    first = LocalServer(small_tile_index, workers=1, extra_args=spool).start()
    try:
        producer = Producer(first.target, job="partial", plan=plan, heartbeat_s=0, connection=CONNECTION)
        producer.put({"id": "r", "tokens": [300] * 4, "unfinished": True, "token_versions": [0] * 4})
        producer.put({"id": "w", "tokens": [301] * 3})
        claimed = producer.claim()
        assert claimed.id == "r" and claimed.tokens.tolist() == [300] * 4
    finally:
        first.process.kill()  # kill -9, mid-claim
        first.process.wait()
    with LocalServer(small_tile_index, workers=1, extra_args=spool) as second:
        stream = PackStream(second.target, job="partial", rank=0, plan=plan, connection=CONNECTION)
        other = Producer(second.target, job="partial", heartbeat_s=0, connection=CONNECTION)
        rollout = other.claim(wait_s=10)
        assert rollout is not None and rollout.id == "r" and rollout.token_versions.tolist() == [0] * 4
        other.put(rollout.continued([302, 303], policy_version=1))
        late = Producer(second.target, job="partial", heartbeat_s=0, connection=CONNECTION, on_refused="return")
        refused = late.put(claimed.continued([309], policy_version=1))
        assert not refused.accepted and "finished by its part 1" in refused.reason
        other.end()
        trained = {}
        for step in stream:
            for pack in step.packs:
                cu = pack.cu_seqlens.tolist()
                for k, key in enumerate(pack.sample_keys):
                    assert key not in trained
                    trained[key] = pack.token_policy_version[cu[k]:cu[k + 1]].tolist()
        stream.close()
    assert trained == {"r": [0, 0, 0, 0, 1, 1], "w": [0, 0, 0]}
