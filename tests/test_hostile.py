"""Ordinary client mishaps and hostile requests never stall the server or leak its memory: cancels at every
point of a step, unbounded or malformed requests, acknowledgements of steps never sent. Real `packfeed serve`
processes, real gRPC on loopback."""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest

from ports import free_port
from processes import workers
from test_contract import OLD_CLIENT_OPEN
from packfeed.client import LocalServer, PackfeedError, PackStream
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1 import packfeed_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
PLAN = pb.PlanSpec(dp=2, microbatches=2, pipeline_stages=2)
PARTS = "/packfeed.v1.Packfeed/StreamPackParts"




@pytest.fixture(scope="module")
def server(small_tile_index):
    port = free_port()
    with LocalServer(small_tile_index, workers=1, metrics_port=port,
                     env={"PACKFEED_MEMORY_BUDGET_MB": "128", "PACKFEED_PACK_PART_KB": "64"}) as running:
        running.metrics_port = port
        yield running


def metric(server, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def wait_for(condition, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


@pytest.mark.parametrize("parts_read", [0, 1, 3, 40, 200])
def test_a_cancel_at_any_point_of_a_step_gives_back_its_memory(server, parts_read):
    """A client that cancels mid-step (raw gRPC: before any part, mid-pack, after packs and steps) leaves no
    room reserved: the held bytes return to zero, and new streams keep getting data."""
    channel = grpc.insecure_channel(server.target)
    job = f"cancel-{parts_read}"
    pb_grpc.PackfeedStub(channel).OpenJob(pb.OpenJobRequest(job=job, plan=PLAN))
    parts = channel.unary_stream(PARTS, request_serializer=pb.StreamPacksRequest.SerializeToString,
                                 response_deserializer=None)
    for rank in range(2):
        call = parts(pb.StreamPacksRequest(job=job, rank=rank))
        for _ in zip(range(parts_read), call):
            pass
        call.cancel()
    with PackStream(server.target, job=job + "-closed", rank=0, dp=2, microbatches=2, pipeline_stages=2) as stream:
        next(stream)  # a trainer that closes its stream with steps in preparation
    assert wait_for(lambda: metric(server, "packfeed_memory_held_bytes") == 0), \
        metric(server, "packfeed_memory_held_bytes")
    with PackStream(server.target, job=job + "-after", rank=1, dp=2, microbatches=2, pipeline_stages=2) as stream:
        assert len(list(stream)) > 0
    channel.close()


def code_and_message(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


def resume_chain(links: int) -> pb.ResumeFrom:
    """A resume of a resumed job of a resumed job ..., `links` deep."""
    message = pb.ResumeFrom(plan=PLAN, step=1, plan_fingerprint="f" * 32)
    for _ in range(links - 1):
        message = pb.ResumeFrom(plan=PLAN, step=1, plan_fingerprint="f" * 32, previous=message)
    return message


def test_hostile_requests_get_quick_clear_refusals(server):
    channel = grpc.insecure_channel(server.target)
    stub = pb_grpc.PackfeedStub(channel)
    raw_open = channel.unary_unary("/packfeed.v1.Packfeed/OpenJob", request_serializer=None,
                                   response_deserializer=None)
    long_id = "j" * (16 << 10)
    refusals = {
        "dp 2^32-1": lambda: stub.OpenJob(pb.OpenJobRequest(job="h", plan=pb.PlanSpec(dp=2**32 - 1))),
        "dp unset": lambda: stub.OpenJob(pb.OpenJobRequest(job="h", plan=pb.PlanSpec(microbatches=2))),
        "M 10^6": lambda: stub.OpenJob(pb.OpenJobRequest(job="h", plan=pb.PlanSpec(dp=2, microbatches=10**6))),
        "ISF 2^32-1": lambda: stub.OpenJob(pb.OpenJobRequest(job="h", plan=pb.PlanSpec(dp=2, isf_iterations=2**32 - 1))),
        "NaN cost": lambda: stub.OpenJob(pb.OpenJobRequest(job="h", plan=pb.PlanSpec(
            dp=2, cost_model=pb.CostCoefficients(llm_linear=float("nan"))))),
        "16 KiB id": lambda: stub.OpenJob(pb.OpenJobRequest(job=long_id, plan=PLAN)),
        "16 KiB get": lambda: stub.GetJob(pb.GetJobRequest(job=long_id)),
        "control chars": lambda: stub.OpenJob(pb.OpenJobRequest(job="a\nb", plan=PLAN)),
        "garbage bytes": lambda: raw_open(b"\xff\xff\xff\xff\x0f garbage"),
        "invalid utf-8": lambda: raw_open(b"\x0a\x02\xff\xfe"),  # field 1 (job), 2 bytes that are not UTF-8
        "resume unnamed": lambda: stub.OpenJob(pb.OpenJobRequest(job="h", plan=PLAN, resume=pb.ResumeFrom(
            plan=PLAN, step=1))),
        "resume chain": lambda: stub.OpenJob(pb.OpenJobRequest(job="h", plan=PLAN, resume=resume_chain(40))),
    }
    for name, call in refusals.items():
        started = time.monotonic()
        code, message = code_and_message(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, message)
        assert time.monotonic() - started < 10, name  # refused, not planned (a bound a loaded host keeps)
        assert long_id not in message and len(message) < 1000, name
    old = pb.JobInfo.FromString(raw_open(OLD_CLIENT_OPEN))  # an earlier v1 client's bytes: zeros are defaults
    assert old.job == "old-node" and (old.plan.microbatches, old.plan.pipeline_stages) == (1, 1)
    stub.OpenJob(pb.OpenJobRequest(job="acks", plan=PLAN))
    code, message = code_and_message(lambda: stub.AckStep(pb.AckStepRequest(job="acks", rank=1, step=1)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "was not sent" in message
    for wait in (float("nan"), float("inf"), -1.0):
        code, message = code_and_message(lambda: stub.AckStep(pb.AckStepRequest(job="acks", data_wait_s=wait)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "data_wait_s" in message, (wait, code, message)
    assert stub.GetJob(pb.GetJobRequest(job="acks")).ranks[1].acked_step == -1
    with PackStream(server.target, job="acks", rank=0, dp=2, microbatches=2, pipeline_stages=2) as stream:
        assert len(list(stream)) > 0  # the server keeps serving
    channel.close()


def test_jobs_are_closed_bounded_and_forgotten_when_idle(small_tile_index):
    # jobs idle for 2 s are forgotten; the 1,000-epoch job's later epochs are counted in the background, so its
    # open does not keep job b idle that long
    with LocalServer(small_tile_index, workers=1, env={"PACKFEED_MAX_JOBS": "2", "PACKFEED_JOB_IDLE_S": "2",
                                                       "PACKFEED_COUNT_AT_OPEN_S": "0"}) as run:
        stub = pb_grpc.PackfeedStub(grpc.insecure_channel(run.target))
        for job in ("a", "b"):
            stub.OpenJob(pb.OpenJobRequest(job=job, plan=PLAN))
        assert code_and_message(lambda: stub.OpenJob(pb.OpenJobRequest(job="c", plan=PLAN)))[0] == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
        stub.CloseJob(pb.CloseJobRequest(job="a"))
        assert code_and_message(lambda: stub.GetJob(pb.GetJobRequest(job="a")))[0] == grpc.StatusCode.NOT_FOUND
        # 1,000 epochs: the stream cannot reach its end behind the client's back (one epoch of this small data
        # fits in gRPC's flow-control window, and a finished stream no longer holds the job)
        stub.OpenJob(pb.OpenJobRequest(job="c", plan=PLAN, epochs=1000))
        listed = {job.job for job in stub.ListJobs(pb.ListJobsRequest()).jobs}  # (b idle 2 s on a loaded machine:
        assert "c" in listed and listed <= {"b", "c"}, listed                  # it may be forgotten already)
        parts = stub.StreamPackParts(pb.StreamPacksRequest(job="c", rank=0))
        next(parts)  # a rank streams from c: it cannot be closed under it, nor forgotten
        code, message = code_and_message(lambda: stub.CloseJob(pb.CloseJobRequest(job="c")))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "open pack streams" in message
        assert wait_for(lambda: [job.job for job in stub.ListJobs(pb.ListJobsRequest()).jobs] == ["c"], 30)
        parts.cancel()
        # a client whose job was forgotten opens it again and gets the very same plan
        with PackStream(run.target, job="b", rank=0, dp=2, microbatches=2, pipeline_stages=2) as again:
            assert again.info.job == "b" and len(list(again)) > 0


def test_planning_one_job_never_blocks_another(small_tile_index):
    """Planning runs off the registry lock: while a large job plans, a small one opens, and a rank joining the
    large job waits for that one planning run (the same Job, planned once)."""
    import dataclasses
    import threading

    from packfeed.server.index.table import read_index_info
    from packfeed.server.serve.datasets import Dataset
    from packfeed.server.serve.job_spec import JobError, JobSpec
    from packfeed.server.serve.registry import JobRegistry
    from packfeed.server.serve.step_work import DatasetSource
    from packfeed.v1.options import PlanConfig

    source = DatasetSource(str(small_tile_index), read_index_info(small_tile_index).tokenizer["path"])
    small = Dataset.open("small", source)
    big = dataclasses.replace(small, name="big")
    planning, release = threading.Event(), threading.Event()

    def long_planning(config, loads=None):  # the large job's planning lasts until the test has opened the small
        planning.set()
        assert release.wait(60), "the test never released the large job's planning"
        return small.caps(config, loads)

    big.caps = long_planning
    registry = JobRegistry({"small": small, "big": big})
    opened: dict[str, object] = {}

    def open_big(name):
        opened[name] = registry.open_job(JobSpec("big-job", "big", PlanConfig(dp=8), 0))

    planner = threading.Thread(target=open_big, args=("first",))
    planner.start()
    assert planning.wait(10) and "big-job" in registry.jobs
    joiner = threading.Thread(target=open_big, args=("joined",))
    joiner.start()
    with pytest.raises(JobError, match="still being planned"):
        registry.get("big-job")
    registry.open_job(JobSpec("small-job", "small", PlanConfig(dp=2, microbatches=2), 0))
    assert registry.get("small-job").spec.dataset == "small"
    assert planner.is_alive() and joiner.is_alive(), "a rank joining the large job did not wait for its planning"
    release.set()
    planner.join(60)
    joiner.join(60)
    assert opened["first"] is opened["joined"] is registry.get("big-job")


def test_a_worker_killed_mid_epoch_is_replaced_and_the_epoch_completes(small_tile_index):
    """The OOM killer takes a pre-processing worker: the pool is started afresh, health says NOT_SERVING only
    meanwhile, and the client's retry finishes the epoch with every sample exactly once."""
    import os
    import signal

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from packfeed.server.index.table import read_index

    table, _ = read_index(small_tile_index, columns=["key", "valid"])
    valid = sorted(k for k, v in zip(table.column("key").to_pylist(), table.column("valid").to_pylist()) if v)

    with LocalServer(small_tile_index, workers=1) as server:
        keys = []
        with PackStream(server.target, job="oom", rank=0, dp=1, microbatches=2, prefetch=1, retries=8,
                        backoff=0.2) as stream:
            steps = iter(stream)
            keys += next(steps).sample_keys
            os.kill(workers(server.process.pid)[0], signal.SIGKILL)
            keys += [key for step in steps for key in step.sample_keys]
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.target))
        assert wait_for(lambda: health.Check(health_pb2.HealthCheckRequest()).status ==
                        health_pb2.HealthCheckResponse.SERVING, 10)
        assert any("worker pool restarted" in line for line in server.log)
    assert sorted(keys) == valid


def test_sigterm_stops_a_busy_server_within_seconds(small_tile_index):
    with LocalServer(small_tile_index, workers=1) as server:
        stream = PackStream(server.target, job="drain", rank=0, dp=1, microbatches=2, prefetch=2)
        next(iter(stream))  # a stream with steps in preparation
        started = time.monotonic()
        server.process.terminate()
        server.process.wait(20)
        assert time.monotonic() - started < 10
        stream.close()


def test_half_open_status_connections_leave_threads_and_log_bounded(server):
    """300 connections to the status port that send half a request and hang: the server's threads stay
    bounded (the connection limit), every such connection is closed by the read timeout or at once, the page
    keeps answering, and clients that vanish cost a log line per kind, never a traceback each."""
    import socket
    import struct

    from packfeed.server.serve.status import MAX_CONNECTIONS

    def threads() -> int:
        status = open(f"/proc/{server.process.pid}/status").read()
        return int(status.split("Threads:")[1].split()[0])

    logged = len(server.log)
    before = threads()
    sockets = []
    for _ in range(300):
        sock = socket.create_connection(("127.0.0.1", server.metrics_port), timeout=10)
        sock.sendall(b"GET /status.json HTTP/1.1\r\nHost: x\r\n")  # and never the blank line that ends it
        sockets.append(sock)
    peak = max(threads() for _ in range(20) if time.sleep(0.1) is None)
    for sock in sockets:  # gone without a word: a reset
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    assert peak <= before + MAX_CONNECTIONS + 4, (before, peak)
    assert wait_for(lambda: metric(server, "packfeed_jobs") >= 0)  # the port still answers
    assert wait_for(lambda: threads() <= before + 4), (before, threads())
    lines = server.log[logged:]
    assert not any("Traceback" in line or "BrokenPipe" in line and "dropped" not in line for line in lines)
    assert 1 <= sum("status connections dropped" in line for line in lines) <= 3, lines[-5:]


def test_one_client_holding_status_connections_never_blocks_another_scraper(server):
    """A client (from 127.0.0.2) holds 64 half-open connections to the metrics port: another scraper (from
    127.0.0.1) still reads /metrics at once, since one address gets at most MAX_PER_CLIENT of the connections."""
    import socket
    import struct
    import urllib.request

    from packfeed.server.serve.status import MAX_CONNECTIONS, MAX_PER_CLIENT

    assert MAX_PER_CLIENT < MAX_CONNECTIONS
    held = []
    try:
        for _ in range(64):
            sock = socket.socket()
            sock.settimeout(10)
            sock.bind(("127.0.0.2", 0))
            sock.connect(("127.0.0.1", server.metrics_port))
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never the blank line that ends it
            held.append(sock)
        time.sleep(0.5)  # every one of them accepted (or closed) by now
        for _ in range(3):
            with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5) as answer:
                assert b"packfeed_jobs" in answer.read()
    finally:
        for sock in held:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()


def test_an_embedded_server_ends_with_its_killed_rank(small_tile_index):
    """A rank killed with SIGKILL runs no cleanup: its `LocalServer` notices it is orphaned and stops."""
    import os
    import signal
    import subprocess
    import sys

    rank = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from packfeed.client import LocalServer\n"
        f"server = LocalServer({str(small_tile_index)!r}, workers=1).start()\n"
        "print(server.process.pid, flush=True)\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True)
    try:
        served = int(rank.stdout.readline())
        assert os.path.exists(f"/proc/{served}")
        rank.send_signal(signal.SIGKILL)
        rank.wait(30)

        def gone() -> bool:
            try:
                return open(f"/proc/{served}/stat").read().split()[2] == "Z"  # a zombie until init reaps it
            except FileNotFoundError:
                return True

        assert wait_for(gone, 60), "the embedded server outlived its rank"
    finally:
        rank.kill()


def test_an_empty_dataset_is_refused_at_open_saying_so(tmp_path, demo_dataset):
    """A dataset with no valid sample: the job's open says the dataset is empty and why, not that step 0 is
    past the plan."""
    import json

    from demo_data import write_shard
    from packfeed.server.index.config import IndexConfig
    from packfeed.server.index.indexer import build_index

    broken = json.dumps({"conversations": [{"from": "human", "value": "no answer follows"}]}).encode()
    shard = write_shard(tmp_path / "empty-0.tar", [(f"s{k}", {"json": broken}) for k in range(3)])
    build_index([str(shard)], tmp_path / "index.parquet", IndexConfig(tokenizer=str(demo_dataset.tokenizer)),
                workers=1, progress=False)
    with LocalServer(tmp_path / "index.parquet", workers=1) as server:
        with pytest.raises(PackfeedError, match="has no step to stream.*empty.*no valid sample") as refused:
            PackStream(server.target, job="empty", rank=0, dp=1)
        assert "past the plan" not in str(refused.value)
