"""Ordinary client mishaps and hostile requests never stall the server or leak its memory: cancels at every
point of a step, unbounded or malformed requests, acknowledgements of steps never sent. Real `packfeed serve`
processes, real gRPC on loopback."""

from __future__ import annotations

import socket
import time
import urllib.request

import grpc
import pytest

from packfeed.client import LocalServer, PackStream
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1 import packfeed_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow
PLAN = pb.PlanSpec(dp=2, microbatches=2, pipeline_stages=2)
PARTS = "/packfeed.v1.Packfeed/StreamPackParts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
