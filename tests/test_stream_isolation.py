"""A stalled trainer holds only what it needs: under a small memory budget, another job's trainer (or a second
raw stream) gets its steps throughout the stall, and the stalled one, once it reads on, gets exactly the steps
it would have got. Real `packfeed serve`, real gRPC on loopback, the demo's photographs."""

from __future__ import annotations

import threading

import grpc
import pytest

from ports import free_port
from test_hostile import metric, wait_for
from packfeed.client import LocalServer, PackStream
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1 import packfeed_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
PLAN = {"dp": 1, "microbatches": 2}
DEADLINE_S = 240  # a bound on a loaded host; the old server never delivered within any bound


def serving(dataset, budget_mb: int):
    port = free_port()
    running = LocalServer(dataset, workers=1, prefetch_steps=4, metrics_port=port,
                          env={"PACKFEED_MEMORY_BUDGET_MB": str(budget_mb), "PACKFEED_PACK_PART_KB": "64"})
    running.metrics_port = port
    return running


@pytest.fixture(scope="module")
def server(dataset):
    """A 64 MB budget: about two of these steps (25-40 MB each, with their decoding room)."""
    with serving(dataset, 64) as running:
        yield running


def keys_of(steps) -> list[list[str]]:
    return [[key for pack in step.packs for key in pack.sample_keys] for step in steps]


def consume_in_thread(target: str, job: str, epochs: int) -> tuple[threading.Thread, list]:
    got: list = []

    def run():
        with PackStream(target, job=job, rank=0, epochs=epochs, **PLAN) as stream:
            got.extend(stream)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, got


@pytest.fixture(scope="module")
def reference(server) -> list:
    """Every step of the job the tests stream, read without a pause."""
    with PackStream(server.target, job="reference", rank=0, epochs=3, **PLAN) as stream:
        return list(stream)


def stall_beside_another_job(server, reference, before_other=lambda: None) -> None:
    """A trainer takes one step and pauses with its stream open (an eval, a checkpoint, a hung rank) while
    another job's trainer reads its whole job; then it reads on. Both get exactly the plan's steps."""
    stalled = PackStream(server.target, job="stalled", rank=0, epochs=3, **PLAN)
    try:
        first = next(stalled)
        before_other()
        thread, other = consume_in_thread(server.target, "other", epochs=3)
        thread.join(DEADLINE_S)
        assert not thread.is_alive(), f"the other job got {len(other)} steps while a trainer stalled"
        assert keys_of(other) == keys_of(reference)  # the same plan, every step
        rest = list(stalled)  # the stalled trainer reads on (the steps it shed are prepared again)
    finally:
        stalled.close()
    assert keys_of([first] + rest) == keys_of(reference), "a resumed stream got other steps than the plan's"


def test_a_stalled_trainer_never_starves_another_job(server, reference):
    stall_beside_another_job(server, reference)


def test_a_stalled_stream_sheds_what_it_prepared_ahead(dataset, reference):
    """With room for several steps, the stalled stream prepares ahead into all of it; when another stream
    waits, it gives back all but the step its client is receiving, and prepares them again once it reads on."""
    with serving(dataset, 128) as server:
        def prefetched_beyond_a_share():
            assert wait_for(lambda: metric(server, "packfeed_memory_held_bytes") > 64 << 20, 60), \
                metric(server, "packfeed_memory_held_bytes")

        stall_beside_another_job(server, reference, prefetched_beyond_a_share)
        assert metric(server, "packfeed_stream_sheds_total") > 0
        assert wait_for(lambda: metric(server, "packfeed_memory_held_bytes") == 0, 60)


def test_a_raw_stream_that_stops_reading_never_starves_a_second(server, reference):
    channel = grpc.insecure_channel(server.target)
    stub = pb_grpc.PackfeedStub(channel)
    parts = channel.unary_stream("/packfeed.v1.Packfeed/StreamPackParts",
                                 request_serializer=pb.StreamPacksRequest.SerializeToString,
                                 response_deserializer=pb.PackPart.FromString)
    for job in ("raw-a", "raw-b"):
        stub.OpenJob(pb.OpenJobRequest(job=job, epochs=3, plan=pb.PlanSpec(dp=1, microbatches=2)))
    first = parts(pb.StreamPacksRequest(job="raw-a", rank=0))
    next(first)  # one part read, then nothing: the server's writes block
    second = parts(pb.StreamPacksRequest(job="raw-b", rank=0), timeout=DEADLINE_S)
    last_parts = sum(part.last for part in second)  # every pack of the job, to its end
    first.cancel()
    channel.close()
    assert last_parts == sum(len(step.packs) for step in reference) > 0
