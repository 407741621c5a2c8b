"""Serving the encoder on ranks of its own (`encoder_ranks` E > 0, issue [4/6]) over real gRPC from an embedded
server: each LLM rank gets its packs without pixels, each encoder rank only the images it encodes with where
each output goes; every consumed image is encoded once, by the encoder rank its consumer names, with the very
pixels a colocated job serves for it. Encoder ranks stream beside the LLM ranks (leases of their own), and
their acknowledgements are reports that do not move the job."""

from __future__ import annotations

import grpc
import pytest
import torch

from packfeed.client import LocalServer, PackfeedError, PackStream
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1 import packfeed_pb2_grpc as pb_grpc


def copied(steps) -> list:
    for step in steps:
        for pack in step.packs:
            pack.tensors = {name: tensor.clone() for name, tensor in pack.tensors.items()}
    return steps


def images_by_sample(packs) -> dict:
    """(sample key, image number) -> that image's tiles, for packs that carry their own pixels (colocated)."""
    found = {}
    for pack in packs:
        tiles, owners = pack.tiles(), pack.tile_image.tolist()
        numbers: dict[int, int] = {}
        for i, sample in enumerate(pack.image_sample.tolist()):
            k = numbers[sample] = numbers.get(sample, -1) + 1
            found[(pack.sample_keys[sample], k)] = [t for t, image in zip(tiles, owners) if image == i]
    return found


def assert_encoded_once(llm: dict, encoders: dict, colocated: dict) -> int:
    """Every image an LLM pack consumes is encoded exactly once, by the encoder rank its `image_encoder` names,
    with its span's placeholder count and the colocated job's very tiles; nothing is encoded for no consumer.
    Returns the images checked."""
    checked = 0
    for position in range(len(llm[0])):
        encoded = {}  # (consumer, microbatch, member, k) -> (encoder rank, tokens, tiles)
        for e, steps in encoders.items():
            for pack in steps[position].packs:
                assert pack.encoder and pack.rank == e and len(pack.input_ids) == 0
                tiles, owners = pack.tiles(), pack.tile_image.tolist()
                for i, ((consumer, member, k), tokens) in enumerate(zip(pack.encode_target.view(-1, 3).tolist(),
                                                                        pack.encode_tokens.tolist())):
                    image = (consumer, pack.microbatch, member, k)
                    assert image not in encoded, f"{image} encoded twice"
                    encoded[image] = (e, tokens, [t for t, owner in zip(tiles, owners) if owner == i])
        for rank, steps in llm.items():
            for pack in steps[position].packs:
                assert not pack.encoder and len(pack.pixels) == 0 and len(pack.tile_shapes) == 0
                rows = zip(pack.image_encoder.view(-1, 3).tolist(), pack.image_token_spans.view(-1, 2).tolist(),
                           pack.image_sample.tolist())
                for (encoder, member, k), (_, length), sample in rows:
                    got_encoder, tokens, tiles = encoded.pop((rank, pack.microbatch, member, k))
                    assert (got_encoder, tokens) == (encoder, length)
                    expected = colocated[(pack.sample_keys[sample], k)]
                    assert len(tiles) == len(expected) > 0 and all(map(torch.equal, tiles, expected))
                    checked += 1
        assert not encoded, f"images encoded for no consumer: {sorted(encoded)}"
    return checked


@pytest.mark.parametrize("dp, encoder_ranks", [(2, 1), (3, 2)])
def test_encoder_ranks_get_only_what_they_encode_and_llm_ranks_no_pixels(small_tile_index, dp, encoder_ranks):
    plan = dict(dp=dp, microbatches=2, seed=0, encoder_ranks=encoder_ranks)
    with LocalServer(small_tile_index, workers=1) as server:
        streams = [PackStream(server.target, job="split", rank=rank, **plan) for rank in range(dp)]
        streams += [PackStream(server.target, job="split", encoder_rank=e, **plan) for e in range(encoder_ranks)]
        # every stream open at once: an encoder rank's lease is not LLM rank e's
        per_stream = [[] for _ in streams]
        for steps in zip(*streams):
            for got, step in zip(per_stream, steps):
                got.append(step)
        info = streams[0].info
        for stream in streams:
            stream.close()
        llm = {rank: copied(per_stream[rank]) for rank in range(dp)}
        encoders = {e: copied(per_stream[dp + e]) for e in range(encoder_ranks)}
        with PackStream(server.target, job="colocated", rank=0, dp=1, microbatches=2, seed=0) as whole:
            packs = [pack for step in copied(list(whole)) for pack in step.packs]
        colocated, every_key = images_by_sample(packs), sorted(key for pack in packs for key in pack.sample_keys)
        stub = pb_grpc.PackfeedStub(grpc.insecure_channel(server.target))
        status = stub.GetJob(pb.GetJobRequest(job="split"))
    assert len({len(steps) for steps in per_stream}) == 1 and len(llm[0]) == info.steps_per_epoch
    assert all(len(step.packs) == 2 for steps in per_stream for step in steps)
    assert assert_encoded_once(llm, encoders, colocated) == len(colocated) > 0  # every image of the epoch
    assert sorted(key for steps in llm.values() for step in steps for key in step.sample_keys) == every_key
    last = (0, info.steps_per_epoch - 1)
    assert [(r.acked_epoch, r.acked_step) for r in status.ranks] == [last] * dp
    assert [(r.acked_epoch, r.acked_step) for r in status.encoder_ranks] == [last] * encoder_ranks


def test_encoder_rank_requests_are_checked_and_acknowledgements_do_not_move_the_job(tmp_path, small_tile_index):
    """Bad encoder-rank requests get a clear error and other jobs go on; an encoder rank's acknowledgement is
    recorded as its own and never moves the LLM ranks' position; states of encoder ranks resume as such."""
    import yaml

    config = tmp_path / "server.yaml"
    config.write_text(yaml.safe_dump({"datasets": {"tiles": {"index": str(small_tile_index)},
                                                   "files": {"index": str(small_tile_index), "pixels": "encoded"}}}))
    with LocalServer(config=config, workers=1) as server:
        stub = pb_grpc.PackfeedStub(grpc.insecure_channel(server.target))
        with pytest.raises(grpc.RpcError) as refused:  # image files are cut by the consuming client
            stub.OpenJob(pb.OpenJobRequest(job="files", dataset="files", plan=pb.PlanSpec(dp=2, encoder_ranks=1)))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "encoder_ranks" in refused.value.details() and "pixels: exact" in refused.value.details()

        plan = dict(dataset="tiles", dp=2, microbatches=2, seed=0)
        stub.OpenJob(pb.OpenJobRequest(job="plain", dataset="tiles", plan=pb.PlanSpec(dp=2, microbatches=2)))
        with pytest.raises(PackfeedError, match="no encoder ranks"):
            list(PackStream(server.target, job="plain", encoder_rank=0, **plan))
        with pytest.raises(PackfeedError, match="outside the job's 1 encoder ranks"):
            PackStream(server.target, job="split", encoder_rank=1, encoder_ranks=1, epochs=4, **plan)
        with pytest.raises(ValueError, match="exactly one of them"):
            PackStream(server.target, job="split", rank=0, encoder_rank=0, encoder_ranks=1, epochs=4, **plan)
        with pytest.raises(grpc.RpcError) as refused:  # the server says so too
            next(stub.StreamPacks(pb.StreamPacksRequest(job="plain", rank=0, encoder=True)))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no encoder ranks" in \
            refused.value.details()
        with pytest.raises(grpc.RpcError) as refused:  # past the job's encoder ranks, straight to the server
            next(stub.StreamPacks(pb.StreamPacksRequest(job="split", rank=3, encoder=True)))
        assert refused.value.code() == grpc.StatusCode.OUT_OF_RANGE

        encoder = PackStream(server.target, job="split", encoder_rank=0, encoder_ranks=1, epochs=4, **plan)
        first = next(iter(encoder))
        with pytest.raises(grpc.RpcError) as refused:  # a step it was not sent (epochs ahead of any prefetch)
            stub.AckStep(pb.AckStepRequest(job="split", rank=0, epoch=3, step=0, encoder=True))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "encoder rank 0" in \
            refused.value.details()
        stub.AckStep(pb.AckStepRequest(job="split", rank=0, epoch=0, step=first.step, encoder=True, data_wait_s=2.5))
        status = stub.GetJob(pb.GetJobRequest(job="split"))
        assert [(r.acked_epoch, r.acked_step) for r in status.ranks] == [(-1, -1)] * 2  # the job has not moved
        assert (status.encoder_ranks[0].acked_epoch, status.encoder_ranks[0].acked_step) == (0, first.step)
        state = encoder.state_dict()
        encoder.close()
        assert state["encoder"] and state["rank"] == 0

        again = PackStream(server.target, job="split", encoder_rank=0, encoder_ranks=1, epochs=4, **plan)
        again.load_state_dict(state)
        following = next(iter(again))
        again.close()
        assert following.step == first.step + 1 and following.packs[0].encoder
        llm = PackStream(server.target, job="split", rank=0, encoder_ranks=1, epochs=4, **plan)
        with pytest.raises(PackfeedError, match="state is of encoder rank 0, this stream is rank 0"):
            llm.load_state_dict(state)
        llm.close()
        stub.OpenJob(pb.OpenJobRequest(job="after", dataset="tiles", plan=pb.PlanSpec(dp=1)))  # others go on
