"""One layout, one seat (`packfeed.v1.layout`): `Layout.problems()` holds the rules of which degrees combine, and
the plan, the trainer's config and the server each refuse with its message; a consumer's `Seat` travels as one
wire message (v1's separate fields still work and say the same), over real gRPC."""

from __future__ import annotations

import grpc
import pytest

from packfeed.client import LocalServer, PackStream, PlanConfig
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1 import packfeed_pb2_grpc as pb_grpc
from packfeed.v1.layout import Layout, Seat

# each unsupported combination, and the words of the one message that refuses it
REFUSED = [(Layout(2, pp=2, cp=2), "runs at pp 1"), (Layout(2, cp=2, encoder_ranks=1), "do not combine yet"),
           (Layout(2, cp=3), "power of 2"), (Layout(0), "must be >= 1"), (Layout(2, encoder_ranks=-1), "must be >= 0")]


@pytest.mark.parametrize("layout, words", REFUSED)
def test_each_unsupported_layout_is_refused_with_one_message_by_the_plan_and_the_trainer(layout, words):
    from packfeed.trainer.config import ParallelConfig

    (message,) = layout.problems()
    assert words in message
    with pytest.raises(ValueError, match="invalid layout") as raised:
        layout.checked()
    assert message in str(raised.value)
    with pytest.raises(ValueError) as planned:
        PlanConfig(dp=layout.dp, pipeline_stages=layout.pp, context_parallel=layout.cp,
                   encoder_ranks=layout.encoder_ranks)
    assert message in str(planned.value)
    encoder = "disaggregated" if layout.encoder_ranks > 0 else "stages"
    with pytest.raises(ValueError) as trained:
        ParallelConfig(dp=layout.dp, pp=layout.pp, cp=layout.cp, encoder_ranks=layout.encoder_ranks, encoder=encoder)
    assert message in str(trained.value)


def test_supported_layouts_name_their_runner_and_world():
    assert [Layout(4).runner, Layout(2, pp=2).runner, Layout(2, cp=4).runner, Layout(2, pp=2, encoder_ranks=1).runner] \
        == ["whole", "pipeline", "context_parallel", "disaggregated"]
    assert Layout(2, pp=2, encoder_ranks=3).world == 7 and Layout(8, cp=4).world == 32
    assert all(not layout.problems() for layout in (Layout(1), Layout(8, cp=8), Layout(2, pp=4, encoder_ranks=2)))
    assert PlanConfig(dp=4, context_parallel=2).layout == Layout(4, cp=2)


def test_every_seat_of_a_layout_has_a_lease_of_its_own():
    layout = Layout(3, cp=4)
    seats = [Seat(rank, replica, lane) for rank in range(3) for lane in range(4) for replica in range(3)]
    seats += [Seat(rank, replica, encoder=True) for rank in range(2) for replica in range(2)]
    assert len({seat.lease_name for seat in seats}) == len(seats)
    assert Seat(2).lease_name == "2"  # an LLM rank's own lease keeps v1's key
    assert [seat.problems(layout) for seat in seats if not seat.encoder] == [[]] * 36
    assert "no encoder ranks" in Seat(0, encoder=True).problems(layout)[0]
    assert "outside the job's 3 ranks" in Seat(3).problems(layout)[0]
    assert "lane 4 is outside" in Seat(0, lane=4).problems(layout)[0]


def request_packs(stub, **fields) -> list[tuple[int, list[str]]]:
    """Every step a raw StreamPacks request receives: (step, each pack's sample keys)."""
    return [(pack.step, list(pack.sample_keys)) for pack in stub.StreamPacks(pb.StreamPacksRequest(job="seats",
                                                                                                   **fields))]


def test_a_seat_travels_as_one_message_and_v1_fields_say_the_same(small_tile_index):
    plan = PlanConfig(dp=2, microbatches=2)
    with LocalServer(small_tile_index, workers=1) as server:
        with PackStream(server.target, job="seats", seat=Seat(1), plan=plan) as stream:
            by_seat = [(step.step, [pack.sample_keys for pack in step.packs]) for step in stream]
        assert stream.rank == 1 and len(by_seat) > 1
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.PackfeedStub(channel)
            seat_form = request_packs(stub, seat=pb.Seat(rank=1, replica=1))
            v1_form = request_packs(stub, rank=1, replica=1, replicas=2)
            assert seat_form == v1_form and [step for step, _ in seat_form][-1] == by_seat[-1][0]
            assert [keys for _, keys in seat_form] == [keys for _, packs in by_seat for keys in packs]
            with pytest.raises(grpc.RpcError) as differing:  # both forms, another place in each
                request_packs(stub, rank=1, seat=pb.Seat(rank=0))
            assert differing.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "differ" in differing.value.details()
            with pytest.raises(grpc.RpcError) as past:
                request_packs(stub, seat=pb.Seat(rank=2))
            assert past.value.code() == grpc.StatusCode.OUT_OF_RANGE and "outside" in past.value.details()
            # an acknowledgement by seat moves its rank; one of another replica is answered, not counted
            assert request_packs(stub, seat=pb.Seat(rank=0))  # rank 0's own seat sent the epoch, nothing acked
            stub.AckStep(pb.AckStepRequest(job="seats", seat=pb.Seat(rank=0, replica=1), step=1))
            info = stub.GetJob(pb.GetJobRequest(job="seats"))
            assert (info.ranks[0].acked_epoch, info.ranks[0].acked_step) == (-1, -1)
            stub.AckStep(pb.AckStepRequest(job="seats", seat=pb.Seat(rank=0), step=0))
            info = stub.GetJob(pb.GetJobRequest(job="seats"))
            assert (info.ranks[0].acked_epoch, info.ranks[0].acked_step) == (0, 0)
    with pytest.raises(ValueError, match="exactly one"):
        PackStream("127.0.0.1:1", job="x", rank=0, seat=Seat(0))
    with pytest.raises(ValueError, match="in the seat"):
        PackStream("127.0.0.1:1", job="x", seat=Seat(0), cp_rank=1)


def test_the_server_refuses_an_unsupported_layout_with_the_layouts_message(small_tile_index):
    (message,) = Layout(2, pp=2, cp=2).problems()
    with LocalServer(small_tile_index, workers=1) as server, grpc.insecure_channel(server.target) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.PackfeedStub(channel).OpenJob(pb.OpenJobRequest(job="bad", plan=pb.PlanSpec(
                dp=2, pipeline_stages=2, context_parallel=2)))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in refused.value.details()
