"""The pack wire format: the server's one-copy encoder and the client's zero-copy reader agree with protobuf."""

from __future__ import annotations

import numpy as np
import pytest

from packfeed.client.stream.wire import PackAssembler, WireFormatError, array_of, split_pack
from packfeed.server.serve.packs import Pack
from packfeed.server.serve.wire import encode_pack, pack_parts
from packfeed.v1 import packfeed_pb2 as pb


def _pack() -> Pack:
    tensors = {"input_ids": np.arange(5, dtype=np.int32),
               "pixels": np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4),
               "big_endian": np.arange(6, dtype=">i4").reshape(3, 2)[::2],
               "nothing": np.zeros((0, 2), np.int32)}
    return Pack(1, 7, 2, 1, ["a", "b"], tensors, loss_tokens=3, skipped=[("c", "undecodable image")],
                step_loss_tokens=11)


def _protobuf_message(pack: Pack) -> pb.Pack:
    message = pb.Pack(epoch=1, step=7, rank=2, microbatch=1, microbatches=2, empty=False, last_in_epoch=True,
                      sample_keys=["a", "b"], loss_tokens=3, step_loss_tokens=11,
                      skipped=[pb.SkippedSample(key="c", reason="undecodable image", epoch=1, step=7)])
    for name, array in pack.tensors.items():
        little = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"))
        message.tensors[name].CopyFrom(pb.Tensor(dtype=little.dtype.name, shape=array.shape,
                                                 data=little.tobytes()))
    return message


def test_encoded_pack_is_the_protobuf_message():
    pack = _pack()
    decoded = pb.Pack.FromString(encode_pack(pack, 2, True))
    for tensor in decoded.tensors.values():
        assert not tensor.align.strip(b"\0")  # padding only
        tensor.ClearField("align")
    assert decoded == _protobuf_message(pack)
    assert decoded.tensors["big_endian"].dtype == "int32"  # always little-endian on the wire
    assert np.array_equal(np.frombuffer(decoded.tensors["big_endian"].data, "<i4").reshape(2, 2), [[0, 1], [4, 5]])


@pytest.mark.parametrize("encoder", ["packfeed", "protobuf"])
def test_reader_gives_views_of_the_message_bytes(encoder):
    pack = _pack()
    message = encode_pack(pack, 2, True) if encoder == "packfeed" else _protobuf_message(pack).SerializeToString()
    fields, wires = split_pack(message)
    assert (fields.epoch, fields.step, fields.microbatches, fields.last_in_epoch) == (1, 7, 2, True)
    assert list(fields.sample_keys) == ["a", "b"] and fields.skipped[0].key == "c" and not fields.tensors
    assert sorted(wires) == sorted(pack.tensors)
    for name, expected in pack.tensors.items():
        array = array_of(message, wires[name])
        assert array.shape == expected.shape and np.array_equal(array, expected)
        assert array.dtype.isnative
    pixels = array_of(message, wires["pixels"])
    assert not pixels.flags.writeable and np.shares_memory(pixels, np.frombuffer(message, np.uint8))
    if encoder == "packfeed":  # every non-empty payload starts at a multiple of 64 bytes of the message
        assert all(wire.offset % 64 == 0 for wire in wires.values() if wire.nbytes)


def test_reader_refuses_malformed_messages():
    message = encode_pack(_pack(), 2, True)
    with pytest.raises(WireFormatError, match="past the end"):
        split_pack(message[:-3])
    with pytest.raises(WireFormatError, match="truncated varint"):
        split_pack(b"\x08\x80")
    bad_shape = pb.Pack(tensors={"x": pb.Tensor(dtype="int32", shape=[3], data=b"\0" * 8)}).SerializeToString()
    with pytest.raises(WireFormatError, match="cannot hold 8 bytes"):
        split_pack(bad_shape)
    bad_dtype = pb.Pack(tensors={"x": pb.Tensor(dtype="float99", shape=[1], data=b"\0")}).SerializeToString()
    with pytest.raises(WireFormatError, match="unknown tensor dtype"):
        split_pack(bad_dtype)


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 640])
def test_pack_parts_are_bounded_protobuf_messages_that_join_back(size):
    message = bytes(range(256)) * (size // 256) + bytes(size % 256)
    parts = list(pack_parts(message, 64))
    assert len(parts) == max(1, -(-size // 64))
    decoded = [pb.PackPart.FromString(part) for part in parts]  # what any protobuf reader sees
    assert all(len(d.data) <= 64 for d in decoded)
    assert [d.last for d in decoded] == [False] * (len(parts) - 1) + [True]
    assert b"".join(d.data for d in decoded) == message
    assembler = PackAssembler()
    joined = [assembler.add(part) for part in parts]
    assert joined[:-1] == [None] * (len(parts) - 1) and joined[-1] == message and not assembler.partial


@pytest.mark.parametrize("cuts", [(), (0,), (5,), (64,), (63, 64, 65), (1, 2, 3, 200, 639)])
def test_pack_parts_of_a_message_held_in_pieces_are_those_of_the_joined_message(cuts):
    """A worker leaves a pack's tiles where it cut them in the step's file, so a message may lie in several
    views (`SplitMessage`): its parts are the same bytes as the joined message's, parts spanning pieces."""
    from packfeed.server.serve.wire import SplitMessage

    message = bytes(range(256)) * 2 + bytes(128)
    bounds = [0, *cuts, len(message)]
    split = SplitMessage(tuple(memoryview(message)[a:b] for a, b in zip(bounds[:-1], bounds[1:])))
    assert len(split) == len(message) and bytes(split) == message
    for part_bytes in (1, 64, 100, 1 << 20):
        assert list(pack_parts(split, part_bytes)) == list(pack_parts(message, part_bytes))


def test_the_assembler_reads_parts_any_protobuf_writer_made():
    assembler = PackAssembler()
    assert assembler.add(pb.PackPart(data=b"abc").SerializeToString()) is None and assembler.partial
    assert assembler.add(pb.PackPart(last=True).SerializeToString()) == b"abc"  # data unset: empty piece
    assert assembler.add(pb.PackPart(data=b"xyz", last=True).SerializeToString()) == b"xyz"
