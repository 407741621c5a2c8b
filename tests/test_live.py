"""Live jobs end to end: real `packfeed serve` processes with a live spool, real gRPC on loopback, producers putting
samples (text-only, and with images referencing an indexed prompt or sent as files) while two trainer ranks
stream them; a server killed mid-job and restarted on its spool; `packfeed put`; bad input; a full spool."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest
from PIL import Image

from ports import free_port
from packfeed.client import Connection, LocalServer, PackfeedError, PackStream, PlanConfig, Producer
from packfeed.media.image_policy import policy_from_dict

pytestmark = pytest.mark.slow
TOKEN = "live-secret"
CONNECTION = Connection(token=TOKEN, retries=8, backoff=0.25)
LIVE = PlanConfig(dp=2, microbatches=1, live=True, step_samples=8)


@pytest.fixture(scope="module")
def server(small_tile_index, tmp_path_factory):
    spool, port = tmp_path_factory.mktemp("spool"), free_port()
    with LocalServer(small_tile_index, workers=1, env={"PACKFEED_AUTH_TOKEN": TOKEN}, metrics_port=port,
                     extra_args=["--live-spool", str(spool)]) as running:
        running.spool, running.metrics_port = spool, port
        yield running


@pytest.fixture(scope="module")
def prompts(server):
    """The prompt side as rollout workers see it: an ordinary job over the index, each prompt's key, its tokens
    (image placeholders included) and its images' count."""
    stream = PackStream(server.target, job="prompts", rank=0, plan=PlanConfig(dp=1), connection=CONNECTION)
    out = {}
    for step in stream:
        for pack in step.packs:
            cu = pack.cu_seqlens.tolist()
            for k, key in enumerate(pack.sample_keys):
                out[key] = (pack.input_ids[cu[k]:cu[k + 1]].numpy().copy(), int((pack.image_sample == k).sum()))
    stream.close()
    return out, stream.conventions


def response(rng, conventions, n: int) -> np.ndarray:
    """n token ids a policy might generate: in the vocabulary, never an image marker."""
    markers = {conventions.image_context_id, conventions.image_start_id, conventions.image_end_id}
    tokens = rng.integers(100, conventions.vocab_size, n)
    return np.array([t if t not in markers else 100 for t in tokens.tolist()], dtype=np.int32)


def text_sample(rng, conventions, sample_id: str, version: int = 0) -> dict:
    n = int(rng.integers(20, 200))
    return {"id": sample_id, "tokens": response(rng, conventions, n), "loss_mask": (np.arange(n) >= 5).astype(np.uint8),
            "group": sample_id[:3], "policy_version": version, "tensors": {"advantages": rng.normal(size=n)}}


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def image_samples(rng, prompts, conventions, count: int) -> list[dict]:
    """Rollouts of indexed prompts with images (by reference), and of prompts whose images come as files."""
    prompt_tokens, _ = prompts
    with_images = [key for key, (_, images) in sorted(prompt_tokens.items()) if images][:count]
    out = []
    for number, key in enumerate(with_images):
        tokens, _ = prompt_tokens[key]
        answer = response(rng, conventions, int(rng.integers(5, 60)))
        out.append({"id": f"img-{number}", "prompt": key, "group": key, "policy_version": 0,
                    "tokens": np.concatenate([tokens, answer]),
                    "loss_mask": np.r_[np.zeros(len(tokens)), np.ones(len(answer))].astype(np.uint8),
                    "tensors": {"advantages": rng.normal(size=len(tokens) + len(answer))}})
    policy = policy_from_dict(json.loads(conventions.image_policy.parameters_json))
    for number, (width, height) in enumerate([(224, 112), (112, 112), (300, 200)]):
        placeholders = policy.cost(width, height, 1).llm_tokens
        tokens = np.concatenate([response(rng, conventions, 7), np.full(placeholders, conventions.image_context_id,
                                                                         np.int32), response(rng, conventions, 30)])
        out.append({"id": f"file-{number}", "images": [png(width, height, number)], "group": f"file-{number}",
                    "tokens": tokens, "loss_mask": (np.arange(len(tokens)) >= 7 + placeholders).astype(np.uint8),
                    "tensors": {"advantages": rng.normal(size=len(tokens))}})
    return out


def consume(target, job: str, rank: int, out: dict, plan: PlanConfig = LIVE, state: dict | None = None,
            stop_after: int | None = None) -> None:
    """Stream a rank of a live job into out[rank]: per step, per sample (key, group, tokens, labels, advantages,
    images, tiles); with `stop_after`, stop there and keep the state to resume from in out["state", rank]."""
    stream = PackStream(target, job=job, rank=rank, plan=plan, connection=CONNECTION)
    if state is not None:
        stream.load_state_dict(state)
    steps = out.setdefault(rank, [])
    try:
        for step in stream:
            samples = []
            for pack in step.packs:
                cu = pack.cu_seqlens.tolist()
                tensors = pack.token_tensors
                for k, key in enumerate(pack.sample_keys):
                    span = slice(cu[k], cu[k + 1])
                    samples.append((key, pack.sample_groups[k], pack.input_ids[span].numpy().copy(),
                                    pack.labels[span].numpy().copy(),
                                    tensors["advantages"][span].numpy().copy() if tensors else None,
                                    int((pack.image_sample == k).sum()), int(pack.policy_version[k])))
            steps.append((step.step, step.last_in_epoch, samples))
            if stop_after is not None and len(steps) >= stop_after:
                out["state", rank] = stream.state_dict()
                return
    except Exception as error:  # noqa: BLE001 - the test reads it
        out["error", rank] = error
    finally:
        stream.close()


def put_while_streaming(target, job: str, samples: list[dict], consumer, seats) -> None:
    """`consumer(seat)` for each seat in a thread of its own (the trainers open the job and wait for samples), then
    `samples` put and the job ended; returns once every consumer has finished (or after 120 s each)."""
    threads = [threading.Thread(target=consumer, args=(seat,)) for seat in seats]
    for thread in threads:
        thread.start()
    with Producer(target, job=job, connection=CONNECTION, open_wait_s=60) as producer:
        producer.put(samples)
        producer.end()
    for thread in threads:
        thread.join(120)


def start_ranks(target, job, out, **kwargs) -> list[threading.Thread]:
    threads = [threading.Thread(target=consume, args=(target, job, rank, out), kwargs=kwargs) for rank in range(2)]
    for thread in threads:
        thread.start()
    return threads


def test_two_producers_and_two_ranks_every_sample_exactly_once(server, prompts):
    conventions = prompts[1]
    rng = np.random.default_rng(0)
    text = [text_sample(rng, conventions, f"txt-{i}") for i in range(24)]
    images = image_samples(rng, prompts, conventions, 9)
    out: dict = {}
    ranks = start_ranks(server.target, "grpo", out)  # the trainers open the job and wait for samples

    def produce(samples, retry_first: bool) -> None:
        with Producer(server.target, job="grpo", connection=CONNECTION, open_wait_s=60,
                      batch_samples=5) as producer:
            for start in range(0, len(samples), 5):
                producer.put(samples[start:start + 5])
            if retry_first:  # a retried put (its answer lost): stored once
                assert all(r.duplicate for r in producer.put(samples[:5]))

    producers = [threading.Thread(target=produce, args=(samples, retry)) for samples, retry in
                 ((text, False), (images, True))]
    for thread in producers:
        thread.start()
    for thread in producers:
        thread.join(120)
    Producer(server.target, job="grpo", connection=CONNECTION, open_wait_s=60).end()
    for thread in ranks:
        thread.join(120)
    assert not [key for key in out if isinstance(key, tuple) and key[0] == "error"], out
    put = {sample["id"]: sample for sample in text + images}
    consumed = [s for rank in range(2) for _, _, samples in out[rank] for s in samples]
    assert sorted(s[0] for s in consumed) == sorted(put)  # every sample, once
    for key, group, tokens, labels, advantages, n_images, version in consumed:
        sample = put[key]
        assert np.array_equal(tokens, sample["tokens"]) and group == sample["group"] and version == 0
        assert np.array_equal(labels, np.where(sample["loss_mask"] > 0, sample["tokens"], -100))
        assert np.allclose(advantages, np.asarray(sample["tensors"]["advantages"], np.float32))
        expected_images = prompts[0][sample["prompt"]][1] if "prompt" in sample else len(sample.get("images", []))
        assert n_images == expected_images
    steps = [[(number, last) for number, last, _ in out[rank]] for rank in range(2)]
    assert steps[0] == steps[1] and steps[0][-1][1] and not any(last for _, last in steps[0][:-1])
    assert len(steps[0]) == -(-len(put) // 8)  # 35 samples: 4 full steps, the end forms the fifth


def test_a_killed_server_restarts_from_its_spool_nothing_lost_or_repeated(small_tile_index, prompts, tmp_path):
    """kill -9 mid-job, restart on the same spool: the resumed trainers get exactly the packs of a run that was
    never interrupted (the same samples put in the same batches into another job)."""
    conventions = prompts[1]
    rng = np.random.default_rng(1)
    first = [text_sample(rng, conventions, f"a-{i}") for i in range(32)]
    later = [text_sample(rng, conventions, f"b-{i}") for i in range(12)]
    port = free_port()
    args = ["--live-spool", str(tmp_path / "spool"), "--listen", f"127.0.0.1:{port}"]

    def run(job: str, interrupted: bool) -> dict:
        out: dict = {}
        env = {"PACKFEED_AUTH_TOKEN": TOKEN}
        server = LocalServer(small_tile_index, workers=1, env=env, extra_args=args).start()
        try:
            with Producer(server.target, job=job, connection=CONNECTION, open_wait_s=60) as producer:
                ranks = start_ranks(server.target, job, out, stop_after=2 if interrupted else None)
                for start in range(0, len(first), 8):
                    producer.put(first[start:start + 8])
                if interrupted:
                    for thread in ranks:
                        thread.join(120)
                    server.process.kill()  # kill -9: no clean-up of any kind
                    server.process.wait()
                    server = LocalServer(small_tile_index, workers=1, env=env, extra_args=args).start()
                    ranks = [threading.Thread(target=consume, args=(server.target, job, rank, out),
                                              kwargs={"state": out["state", rank]}) for rank in range(2)]
                    for thread in ranks:
                        thread.start()
                producer.put(later)
                producer.end()
            for thread in ranks:
                thread.join(120)
        finally:
            server.stop()
        assert not [key for key in out if isinstance(key, tuple) and key[0] == "error"], out
        return out

    interrupted, whole = run("restarted", True), run("uninterrupted", False)
    for rank in range(2):
        assert [(n, last, [(s[0], s[2].tobytes()) for s in samples]) for n, last, samples in interrupted[rank]] == \
            [(n, last, [(s[0], s[2].tobytes()) for s in samples]) for n, last, samples in whole[rank]]
    keys = [s[0] for rank in range(2) for _, _, samples in interrupted[rank] for s in samples]
    assert sorted(keys) == sorted(s["id"] for s in first + later)


def test_bad_input_is_refused_with_its_reason_while_a_bystander_goes_on(server, prompts):
    conventions = prompts[1]
    rng = np.random.default_rng(2)
    capped = PlanConfig(dp=2, microbatches=1, live=True, step_samples=8, token_cap=256, vision_cap=64,
                        oversize="skip")
    out: dict = {}
    ranks = start_ranks(server.target, "bystander", out, plan=capped)
    good = [text_sample(rng, conventions, f"ok-{i}") for i in range(16)]
    bad = text_sample(rng, conventions, "bad")
    n = len(bad["tokens"])
    cases = {
        "vocab": ({**bad, "id": "vocab", "tokens": np.full(n, conventions.vocab_size + 5)}, "tokens", "vocabulary"),
        "lengths": ({**bad, "id": "lengths", "tensors": {"advantages": np.zeros(n + 3)}}, "tensors[advantages]",
                    f"{n + 3} values for {n} tokens"),
        "prompt": ({**bad, "id": "prompt", "prompt": "no-such-sample"}, "prompt", "no indexed sample"),
        "cap": ({**bad, "id": "cap", "tokens": response(rng, conventions, 300), "loss_mask": np.ones(300),
                 "tensors": {"advantages": np.zeros(300)}}, "tokens", "token cap"),
    }
    with Producer(server.target, job="bystander", connection=CONNECTION, open_wait_s=60,
                  on_refused="return") as producer:
        results = producer.put([case for case, _, _ in cases.values()] + good[:8])
        for result, (_, field, reason) in zip(results, cases.values()):
            assert not result.accepted and result.field == field and reason in result.reason, result
        assert all(result.accepted for result in results[len(cases):])
        with pytest.raises(PackfeedError, match="UNAUTHENTICATED"):
            Producer(server.target, job="bystander", token="wrong", connection=None).put(good[8])
        with pytest.raises(PackfeedError, match="not live"):
            Producer(server.target, job="prompts", connection=CONNECTION, open_wait_s=60).put(good[8])
        producer.put(good[8:])
        producer.end()
    for thread in ranks:
        thread.join(120)
    keys = sorted(s[0] for rank in range(2) for _, _, samples in out[rank] for s in samples)
    assert keys == sorted(sample["id"] for sample in good)


def test_packfeed_put_puts_a_json_lines_file(server, prompts, tmp_path):
    """Offline rollouts into a job no trainer has opened yet: `packfeed put --plan` opens it with the trainers'
    plan, then two ranks consume it. Without --plan, the put is told at once that no trainer opened the job."""
    conventions = prompts[1]
    rng = np.random.default_rng(3)
    lines = []
    for i in range(16):
        n = int(rng.integers(10, 80))
        lines.append({"id": f"r{i}", "tokens": response(rng, conventions, n).tolist(), "group": f"q{i // 4}",
                      "loss_mask": [0] * 3 + [1] * (n - 3)})
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text("\n".join(json.dumps(line) for line in lines) + "\n" + json.dumps({"id": "broken"}) + "\n")
    command = [sys.executable, "-m", "packfeed.cli", "put", server.target, str(rollouts), "--end"]
    env = {**os.environ, "PACKFEED_AUTH_TOKEN": TOKEN}
    nobody = subprocess.run(command + ["--job", "nobody"], capture_output=True, text=True, timeout=120, env=env)
    assert nobody.returncode == 2 and "no trainer opened it" in nobody.stderr and "--plan" in nobody.stderr
    plan = "{dp: 2, microbatches: 1, live: true, step_samples: 8}"  # LIVE, the trainers' plan
    put = subprocess.run(command + ["--job", "offline", "--plan", plan], capture_output=True, text=True,
                         timeout=120, env=env)
    assert put.returncode == 3, put.stderr  # one line refused
    assert json.loads(put.stdout) == {"put": 16, "duplicates": 0, "refused": 1, "ended": True}
    assert "rollouts.jsonl:17: line: a sample needs its tokens" in put.stderr
    out: dict = {}
    for thread in start_ranks(server.target, "offline", out):
        thread.join(120)
    assert not [key for key in out if isinstance(key, tuple)], out
    keys = sorted(s[0] for rank in range(2) for _, _, samples in out[rank] for s in samples)
    assert keys == sorted(line["id"] for line in lines)


def test_a_second_server_takes_the_job_over_from_a_shared_spool(small_tile_index, prompts, tmp_path):
    """Two servers share a spool folder and a real Redis. The job's first server is killed -9 mid-job: once its
    lease lapses the other takes the job over from the spool, the producers' and trainers' clients follow, and
    every sample is consumed exactly once, in the packs a single server would have sent. Rank 1 lists the
    standby first, so the standby opened the job (and read its empty spool) while the first server held it: it
    must serve the job from the spool as the holder left it, not as it was at its open."""
    from redis_server import RedisProcess

    conventions = prompts[1]
    rng = np.random.default_rng(4)
    first = [text_sample(rng, conventions, f"a-{i}") for i in range(24)]
    later = [text_sample(rng, conventions, f"b-{i}") for i in range(16)]
    redis = RedisProcess(tmp_path / "redis").start()
    env = {"PACKFEED_AUTH_TOKEN": TOKEN, "PACKFEED_REDIS_URL": redis.url, "PACKFEED_LEASE_TTL_S": "2"}
    spool = ["--live-spool", str(tmp_path / "shared-spool")]
    servers = [LocalServer(small_tile_index, workers=1, env=env, extra_args=spool).start() for _ in range(2)]
    try:
        def run(job: str, kill: bool) -> dict:
            out: dict = {}
            targets = [server.target for server in servers if server.process.poll() is None]
            ranks = [threading.Thread(target=consume, args=(targets[::1 - 2 * rank], job, rank, out))
                     for rank in range(2)]
            with Producer(targets, job=job, connection=CONNECTION, open_wait_s=60) as producer:
                for thread in ranks:
                    thread.start()
                for start in range(0, len(first), 8):
                    producer.put(first[start:start + 8])
                if kill:
                    servers[0].process.kill()
                    servers[0].process.wait()
                for start in range(0, len(later), 8):
                    producer.put(later[start:start + 8])
                producer.end()
            for thread in ranks:
                thread.join(180)
            assert not [key for key in out if isinstance(key, tuple)], out
            return out

        taken_over = run("taken-over", kill=True)
        alone = run("alone", kill=False)  # the surviving server by itself, as the reference
        for rank in range(2):
            assert [(n, [s[0] for s in samples]) for n, _, samples in taken_over[rank]] == \
                [(n, [s[0] for s in samples]) for n, _, samples in alone[rank]]
        keys = [s[0] for rank in range(2) for _, _, samples in taken_over[rank] for s in samples]
        assert sorted(keys) == sorted(s["id"] for s in first + later)
    finally:
        for server in servers:
            server.stop()
        redis.stop()


def test_the_operator_sees_a_live_jobs_arrivals_steps_and_stale_drops(server, prompts):
    """GetJob, Prometheus, the status page's JSON and `packfeed info` on the job's spool folder agree."""
    import urllib.request

    from packfeed.client.stream.channel import ServerChannel
    from packfeed.server.live.spool import job_folder
    from packfeed.v1 import packfeed_pb2 as pb

    conventions = prompts[1]
    rng = np.random.default_rng(5)
    plan = PlanConfig(dp=2, live=True, step_samples=4, max_staleness=0)
    channel = ServerChannel([server.target], CONNECTION)
    request = pb.OpenJobRequest(job="watched", plan=plan.to_proto())
    channel.call("OpenJob", request)
    with Producer(server.target, job="watched", connection=CONNECTION, open_wait_s=60,
                  on_refused="return") as producer:
        producer.put([text_sample(rng, conventions, f"v0-{i}", version=0) for i in range(6)])  # step 0 + 2
        producer.put([text_sample(rng, conventions, f"v1-{i}", version=1) for i in range(4)])  # step 1 drops 2
        producer.put({**text_sample(rng, conventions, "bad"), "tokens": [conventions.vocab_size]})
    live = channel.call("GetJob", pb.GetJobRequest(job="watched")).live
    assert (live.arrived, live.pending, live.steps_formed, live.dropped_stale, live.refused, live.ended) == \
        (10, 0, 2, 2, 1, False)
    assert live.spool_bytes > 0
    headers = {"Authorization": f"Bearer {TOKEN}"}
    base = f"http://127.0.0.1:{server.metrics_port}"
    metrics = urllib.request.urlopen(urllib.request.Request(f"{base}/metrics", headers=headers)).read().decode()
    for line in ('packfeed_live_samples_total{job="watched"} 10.0', 'packfeed_live_steps_formed_total{job="watched"} 2.0',
                 'packfeed_live_stale_samples_total{job="watched"} 2.0', 'packfeed_live_refused_samples_total{job="watched"} 1.0',
                 'packfeed_live_pending_samples{job="watched"} 0.0'):
        assert line in metrics, line
    status = json.loads(urllib.request.urlopen(urllib.request.Request(f"{base}/status.json", headers=headers)).read())
    shown = next(job for job in status["jobs"] if job["job"] == "watched")
    assert shown["live"]["steps_formed"] == 2 and shown["live"]["dropped_stale"] == 2
    info = subprocess.run([sys.executable, "-m", "packfeed.cli", "info", job_folder(server.spool, "watched"),
                           "--json"], capture_output=True, text=True, timeout=60)
    assert info.returncode == 0, info.stderr
    spooled = json.loads(info.stdout)
    assert (spooled["kind"], spooled["steps"], spooled["samples_spooled"], spooled["pending"],
            spooled["dropped_stale"]) == ("live spool", 2, 10, 0, 2)
    channel.close()


def test_a_flooding_producer_keeps_the_server_within_its_bounds(small_tile_index, prompts, tmp_path):
    """A spool bound of 1 MiB: a producer putting 80 MB as fast as it can is refused (RESOURCE_EXHAUSTED, the
    reason said) once the spool is full, the spool and the server's memory stay within bounds, and what it puts
    once trainers consume is every sample exactly once."""
    from processes import tree_resident_mib

    conventions = prompts[1]
    rng = np.random.default_rng(6)
    samples = [text_sample(rng, conventions, f"f-{i}") for i in range(4000)]
    for sample in samples:  # ~20 KB each on the wire
        sample["tokens"] = response(rng, conventions, 2000)
        sample["loss_mask"], sample["tensors"] = np.ones(2000, np.uint8), {"advantages": rng.normal(size=2000)}
    spool = tmp_path / "spool"
    args = ["--live-spool", str(spool), "--live-spool-max-gb", str(1 / 1024)]
    with LocalServer(small_tile_index, workers=1, env={"PACKFEED_AUTH_TOKEN": TOKEN}, extra_args=args) as server:
        producer = Producer(server.target, job="flood", connection=CONNECTION, open_wait_s=60, full_wait_s=0)
        channel_open = PackStream(server.target, job="flood", rank=0, plan=LIVE, connection=CONNECTION,
                                  acknowledge=False)
        producer.put(samples[:10])
        next(iter(channel_open))  # step 0 formed and prepared: the worker process is up, its memory counted
        accepted, refusals, before = 10, 0, None
        for start in range(10, len(samples), 10):  # 400 puts as fast as they go, none waiting
            # The spool is full after a few puts; the server's malloc keeps up to KEEP_FREED_BYTES (128 MiB) of
            # freed memory for reuse, full after 200 refused puts or so: from there the flood must not grow it
            if start == 2500:
                before = tree_resident_mib(server.process.pid)
            try:
                producer.put(samples[start:start + 10])
                accepted = start + 10
            except PackfeedError as error:
                assert error.code.name == "RESOURCE_EXHAUSTED" and "--live-spool-max-gb" in str(error)
                refusals += 1
        grown = tree_resident_mib(server.process.pid) - before
        spooled = sum(path.stat().st_size for path in spool.rglob("*.tar"))
        assert refusals > 350 and accepted < 100
        assert spooled <= (1 << 20) + 10 * 25_000  # the bound and at most one put over it
        assert grown < 16, f"the server grew {grown:.0f} MiB under the last 1,500 samples of the flood"
        channel_open.close()
        out: dict = {}
        ranks = start_ranks(server.target, "flood", out)
        with pytest.raises(PackfeedError, match="larger than the job's whole spool may hold"):
            producer.put(samples[accepted:accepted + 100])  # 2 MB at once could never fit: said at once
        producer.full_wait_s = 300  # waits while the trainers free the spool
        for start in range(accepted, accepted + 300, 10):
            producer.put(samples[start:start + 10])
        producer.end()
        for thread in ranks:
            thread.join(180)
        producer.close()
    assert not [key for key in out if isinstance(key, tuple)], out
    keys = sorted(s[0] for rank in range(2) for _, _, steps in out[rank] for s in steps)
    assert keys == sorted(sample["id"] for sample in samples[:accepted + 300])


def test_the_docs_trainer_and_producer_snippets_run_as_written(small_tile_index, prompts, tmp_path, monkeypatch):
    """docs/live.md's two Python blocks, executed as written: the trainer's on two ranks, the producer's with
    rollouts of indexed prompts; every rank iterates to the job's end."""
    import re
    from dataclasses import dataclass
    from pathlib import Path

    from packfeed.client.stream.channel import ServerChannel
    from packfeed.v1 import packfeed_pb2 as pb

    page = (Path(__file__).resolve().parents[1] / "docs" / "live.md").read_text()
    trainer, producer = re.findall(r"^```python\n(.*?)^```", page, flags=re.M | re.S)[:2]

    @dataclass
    class Rollout:
        id: str
        token_ids: np.ndarray
        loss_mask: np.ndarray
        prompt_key: str
        advantages: np.ndarray

    rng = np.random.default_rng(7)
    rollouts = [Rollout(f"r{number}", np.asarray(sample["tokens"]), sample["loss_mask"], sample["prompt"],
                        sample["tensors"]["advantages"])
                for number, sample in enumerate(image_samples(rng, prompts, prompts[1], 9)) if "prompt" in sample]
    monkeypatch.delenv("PACKFEED_AUTH_TOKEN", raising=False)
    args = ["--live-spool", str(tmp_path / "spool"), "--dataset", "prompts"]
    with LocalServer(small_tile_index, workers=1, extra_args=args) as server:
        spaces = [{"target": server.target, "rank": rank} for rank in range(2)]
        ranks = [threading.Thread(target=exec, args=(trainer, space)) for space in spaces]
        for thread in ranks:
            thread.start()
        exec(producer, {"target": server.target, "rollouts": rollouts, "version": 0})
        for thread in ranks:
            thread.join(120)
        info = ServerChannel([server.target], Connection(token="")).call("GetJob", pb.GetJobRequest(job="grpo-7"))
    assert info.live.ended and info.live.arrived == len(rollouts) == 9 and info.steps == 2  # 8, then the end's 1
    assert all("advantages" in space and space["stream"]._next is None for space in spaces)  # iterated to the end


def test_a_live_job_with_context_parallelism_sends_each_lane_its_share(server, prompts):
    """Samples longer than a GPU holds are split over its rank's CP GPUs: each lane's share carries its zigzag
    chunks of every per-token tensor, beside its tokens, so the loss of every chunk is computed where it runs."""
    from packfeed.client import Seat

    conventions = prompts[1]
    rng = np.random.default_rng(8)
    plan = PlanConfig(dp=1, microbatches=1, live=True, step_samples=6, context_parallel=2, max_tokens_per_gpu=96,
                      token_cap=96, vision_cap=64)
    samples = [text_sample(rng, conventions, f"cp-{i}") for i in range(6)]
    for length, sample in zip((40, 150, 60, 170, 30, 90), samples):  # two need both GPUs
        sample["tokens"] = response(rng, conventions, length)
        sample["loss_mask"], sample["tensors"] = np.ones(length, np.uint8), {"advantages": rng.normal(size=length)}
    shares: dict = {}

    def lane(number: int) -> None:
        with PackStream(server.target, job="cp-live", seat=Seat(0, lane=number), plan=plan,
                        connection=CONNECTION) as stream:
            shares[number] = [pack for step in stream for pack in step.packs]

    put_while_streaming(server.target, "cp-live", samples, lane, range(2))
    put = {sample["id"]: sample for sample in samples}
    split, seen = 0, []
    for number in range(2):
        for pack in shares[number]:
            cu, chunks = pack.cu_seqlens.tolist(), pack.cp_chunks.tolist()
            advantages = pack.token_tensors["advantages"]
            assert len(advantages) == len(pack.input_ids)
            for k, key in enumerate(pack.sample_keys):
                a0, b0, a1, b1 = chunks[k]
                positions = np.r_[a0:b0, a1:b1]
                mine = slice(cu[k], cu[k + 1])
                assert np.array_equal(pack.input_ids[mine].numpy(), put[key]["tokens"][positions])
                assert np.allclose(advantages[mine].numpy(), np.asarray(put[key]["tensors"]["advantages"],
                                                                        np.float32)[positions])
                split += len(positions) < len(put[key]["tokens"])
                seen.append((key, len(positions)))
    assert split >= 4  # the two long samples, half on each lane
    totals = {key: sum(n for other, n in seen if other == key) for key in put}
    assert totals == {key: len(sample["tokens"]) for key, sample in put.items()}  # every token once


def test_a_context_parallel_live_job_refuses_a_sample_sharing_its_groups_prompt(server, prompts):
    """The answer an index with groups gets: a plan with context parallelism shares no prefixes, so a sample
    sharing its group's prompt is refused at its put, naming its group and the way out, not taken and planned
    alone unsaid; in a job opened with shared_prefix false the same sample is taken."""
    conventions = prompts[1]
    shared = text_sample(np.random.default_rng(12), conventions, "cpg-0")  # its 5 first tokens: the prompt
    for job, sharing in (("cp-groups", True), ("cp-alone", False)):
        plan = PlanConfig(dp=1, live=True, step_samples=6, context_parallel=2, max_tokens_per_gpu=256,
                          token_cap=256, vision_cap=64, shared_prefix=sharing)
        with Producer(server.target, job=job, connection=CONNECTION, plan=plan, on_refused="return") as producer:
            (result,) = producer.put([shared])
        if sharing:
            assert not result.accepted and result.field == "group", result
            assert "context parallelism" in result.reason and "shared_prefix false" in result.reason, result
        else:
            assert result.accepted, result


def test_a_groups_responses_come_with_their_prompt_once(server, prompts):
    """G = 4 responses to each of three prompts with images (by reference) and to one prompt sent as image files:
    each group in one pack, its images read and sent once (a sibling carries none, its shared_prefix row names its
    owner); the client's unshared view gives every response its prompt's images, the shared view each prompt once."""
    from packfeed.client.model.shared_prefix import shared, unshared

    conventions = prompts[1]
    rng = np.random.default_rng(3)
    prompt_tokens = prompts[0]
    keys = [key for key, (_, images) in sorted(prompt_tokens.items()) if images][:3]
    image = png(224, 112, 9)
    placeholders = policy_from_dict(json.loads(conventions.image_policy.parameters_json)).cost(224, 112, 1).llm_tokens
    file_prompt = np.concatenate([response(rng, conventions, 6), np.full(placeholders, conventions.image_context_id,
                                                                          np.int32), response(rng, conventions, 9)])
    samples = []
    for g, key in enumerate(keys + ["files"]):
        tokens = prompt_tokens[key][0] if key != "files" else file_prompt
        for k in range(4):
            answer = response(rng, conventions, int(rng.integers(5, 40)))
            sample = {"id": f"{g}-{k}", "group": key, "tokens": np.concatenate([tokens, answer]),
                      "loss_mask": np.r_[np.zeros(len(tokens)), np.ones(len(answer))].astype(np.uint8),
                      "tensors": {"advantages": rng.normal(size=len(tokens) + len(answer))}}
            sample.update({"images": [image]} if key == "files" else {"prompt": key})
            samples.append(sample)
    plan = PlanConfig(dp=2, microbatches=1, live=True, step_samples=16, token_cap=4096, vision_cap=64)
    received: dict = {}

    def consume_packs(rank: int) -> None:  # the trainers open the job and wait for samples
        stream = PackStream(server.target, job="groups", rank=rank, plan=plan, connection=CONNECTION)
        try:
            received[rank] = [pack for step in stream for pack in step.packs if not pack.empty]
        except Exception as error:  # noqa: BLE001 - the test reads it
            received["error", rank] = error
        finally:
            stream.close()

    put_while_streaming(server.target, "groups", samples, consume_packs, range(2))
    assert 0 in received and 1 in received, received
    put = {s["id"]: s for s in samples}
    seen = []
    for pack in received[0] + received[1]:
        rows = pack.shared_prefix.view(-1, 2).tolist()
        groups = [put[key]["group"] for key in pack.sample_keys]
        for k, (owner, size) in enumerate(rows):
            if owner != k:  # a sibling: its owner's group and prompt, no images of its own
                assert groups[owner] == groups[k] and int((pack.image_sample == k).sum()) == 0
                sample = put[pack.sample_keys[k]]
                assert size == len(sample["tokens"]) - int(sample["loss_mask"].sum())
        whole = unshared(pack)
        cu = whole.cu_seqlens.tolist()
        for k, key in enumerate(pack.sample_keys):
            expected = 1 if put[key]["group"] == "files" else prompt_tokens[put[key]["group"]][1]
            assert int((whole.image_sample == k).sum()) == expected
            assert np.array_equal(whole.input_ids[cu[k]:cu[k + 1]].numpy(), put[key]["tokens"])
        laid = shared(pack)  # each prompt's images once
        assert int(laid.image_sample.numel()) == sum(1 if g == "files" else prompt_tokens[g][1] for g in set(groups))
        assert len(set(groups)) * 4 == len(groups)  # every group whole in its pack
        seen += sorted(set(groups))
    assert sorted(seen) == sorted(keys + ["files"])


def test_a_tree_of_trajectories_comes_with_each_shared_turn_and_screenshot_once(server, prompts):
    """Trajectories put over gRPC (turns, a fork's parent and fork_turn): the tree comes as one pack naming each
    fork's parent, its screenshots sent once; the client's unshared view gives every trajectory its turns' images,
    and a fork whose turn brings no image for its placeholders is refused naming the turn."""
    from packfeed.client.model.shared_prefix import unshared

    conventions = prompts[1]
    rng = np.random.default_rng(21)
    placeholders = policy_from_dict(json.loads(conventions.image_policy.parameters_json)).cost(224, 112, 2).llm_tokens

    def observation():
        tokens = np.concatenate([response(rng, conventions, 4), np.full(placeholders, conventions.image_context_id,
                                                                         np.int32), response(rng, conventions, 3)])
        return tokens, {"role": "environment", "tokens": len(tokens), "images": 1}

    def action():
        tokens = response(rng, conventions, int(rng.integers(4, 12)))
        return tokens, {"role": "policy", "tokens": len(tokens)}

    def trajectory(sample_id, turns, images, parent="", fork=0):
        tokens = np.concatenate([t for t, _ in turns])
        mask = np.concatenate([np.full(len(t), int(m["role"] == "policy"), np.uint8) for t, m in turns])
        return {"id": sample_id, "group": "episode", "tokens": tokens, "loss_mask": mask, "images": images,
                "turns": [m for _, m in turns], "parent": parent, "fork_turn": fork,
                "tensors": {"advantages": rng.normal(size=len(tokens))}}

    root = [observation(), action(), observation(), action()]
    fork = root[:2] + [observation(), action()]
    screens = [png(224, 112, 30 + k) for k in range(3)]
    samples = [trajectory("root", root, screens[:2]), trajectory("fork", fork, [screens[2]], "root", 2)]
    bad = trajectory("bad", fork, [], "root", 2)  # its turn 2 brings an image it does not carry
    plan = PlanConfig(dp=1, microbatches=1, live=True, step_samples=2, token_cap=4096, vision_cap=64)
    with Producer(server.target, job="trajectories", connection=CONNECTION, plan=plan, on_refused="return") as producer:
        refused = producer.put(bad)
        assert not refused.accepted and refused.field == "images" and "turn 2 on bring 1 images" in refused.reason
        producer.put(samples)
        producer.end()
    stream = PackStream(server.target, job="trajectories", rank=0, plan=plan, connection=CONNECTION)
    packs = [pack for step in stream for pack in step.packs if not pack.empty]
    stream.close()
    (pack,) = packs
    assert pack.sample_keys == ["root", "fork"]
    assert pack.shared_prefix.view(-1, 2).tolist() == [[0, len(fork[0][0]) + len(fork[1][0])]] * 2
    assert int(pack.image_sample.numel()) == 3  # the root's two screenshots and the fork's own one
    whole = unshared(pack)
    bounds = whole.cu_seqlens.tolist()
    for k, sample in enumerate(samples):
        assert np.array_equal(whole.input_ids[bounds[k]:bounds[k + 1]].numpy(), sample["tokens"])
        assert int((whole.image_sample == k).sum()) == 2


def test_a_producer_fails_over_to_the_next_server_on_not_found(server, small_tile_index, prompts, tmp_path):
    """Producer([A, B]) where A does not know the job (restarted, or never opened it) and B serves it: the put
    goes on to B at once, instead of waiting on A's NOT_FOUND."""
    import time

    from packfeed.client.stream.channel import ServerChannel
    from packfeed.v1 import packfeed_pb2 as pb

    conventions = prompts[1]
    rng = np.random.default_rng(11)
    samples = [text_sample(rng, conventions, f"fo-{i}") for i in range(16)]
    other = LocalServer(small_tile_index, workers=1, env={"PACKFEED_AUTH_TOKEN": TOKEN},
                        extra_args=["--live-spool", str(tmp_path / "other")]).start()
    try:
        out: dict = {}
        ranks = start_ranks(server.target, "elsewhere", out)
        channel = ServerChannel([server.target], CONNECTION)
        for _ in range(240):  # the ranks open the job on B (bounded: 60 s)
            try:
                channel.call("GetJob", pb.GetJobRequest(job="elsewhere"), final=(grpc.StatusCode.NOT_FOUND,))
                break
            except PackfeedError:
                time.sleep(0.25)
        channel.close()
        with Producer([other.target, server.target], job="elsewhere", connection=CONNECTION) as producer:
            producer.put(samples)  # A does not know the job: on to B, at once
            producer.end()
        for thread in ranks:
            thread.join(120)
    finally:
        other.stop()
    assert not [key for key in out if isinstance(key, tuple)], out
    keys = sorted(s[0] for rank in range(2) for _, _, samples_ in out[rank] for s in samples_)
    assert keys == sorted(s["id"] for s in samples)
    # no timing asserted: with open_wait_s 0 (the default) a producer that asked A alone would have raised NOT_FOUND


def test_a_job_opened_with_a_producer_token_takes_puts_and_its_end_only_with_it(server, prompts):
    """Trainers open the job with a producer token: a producer without it (or with another) is refused with
    PERMISSION_DENIED and changes nothing; an open with another token is refused; the token's producer puts and
    ends the job, and the ranks get exactly its samples."""
    conventions = prompts[1]
    rng = np.random.default_rng(12)
    samples = [text_sample(rng, conventions, f"tok-{i}") for i in range(8)]
    out: dict = {}
    threads = [threading.Thread(target=consume, args=(server.target, "guarded", rank, out)) for rank in range(2)]
    opened = PackStream(server.target, job="guarded", rank=0, plan=LIVE, connection=CONNECTION,
                        producer_token="s3cret")  # the job exists with its token before anyone puts
    opened.close()
    for thread in threads:
        thread.start()
    for token in ("", "wrong"):
        with pytest.raises(PackfeedError, match="PERMISSION_DENIED.*producer token"):
            Producer(server.target, job="guarded", connection=CONNECTION, producer_token=token).put(samples[0])
        with pytest.raises(PackfeedError, match="PERMISSION_DENIED"):
            Producer(server.target, job="guarded", connection=CONNECTION, producer_token=token).end()
    with pytest.raises(PackfeedError, match="another producer token"):
        PackStream(server.target, job="guarded", rank=1, plan=LIVE, connection=CONNECTION, producer_token="other")
    with Producer(server.target, job="guarded", connection=CONNECTION, producer_token="s3cret") as producer:
        producer.put(samples)
        producer.end()
    for thread in threads:
        thread.join(120)
    assert not [key for key in out if isinstance(key, tuple)], out
    keys = sorted(s[0] for rank in range(2) for _, _, steps in out[rank] for s in steps)
    assert keys == sorted(s["id"] for s in samples)
    assert not any("s3cret" in line for line in server.log)


def test_a_live_sample_crosses_fewer_than_30_files_from_put_to_the_trainers_pack(small_tile_index):
    """Measured on a real run by tests/live_sample_files.py (every process watches which project functions are
    handed the sample): the path is short, and the measure sees both ends and the middle of it."""
    done = subprocess.run([sys.executable, "tests/live_sample_files.py", "--index", str(small_tile_index), "--json"],
                          capture_output=True, text=True, timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert set(found) == {"text", "image file"}
    for kind, files in found.items():
        assert len(files) < 30, (kind, files)
        assert {"client/stream/producer.py", "loader_server/serve/live_put.py", "loader_server/live/spool.py",
                "loader_server/serve/packs.py", "client/stream/pack_stream.py"} <= set(files), (kind, files)
    assert "media/pixels.py" in found["image file"] and "media/pixels.py" not in found["text"]
