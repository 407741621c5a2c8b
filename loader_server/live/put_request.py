"""A producer's `PutSamplesRequest` read without copying its payload: its samples' token, mask and tensor data and
its image files are views of the received bytes (`packfeed.v1.wire_format`), each sample's small fields read by the
same rules. `PutSamplesRequest.FromString` would copy every bytes field once, and each read of one again: a put
would cost the server three times its size before a sample is checked; read this way it costs its size
(BENCHMARKS "What a put costs the server"). The objects answer what `samples.checked_sample` reads of a
`LiveSample` message."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1.wire_format import FIXED64, LENGTH_DELIMITED, VARINT, WireFormatError, fields, packed_varints, signed64

_REQUEST = {f.name: f.number for f in pb.PutSamplesRequest.DESCRIPTOR.fields}
_SAMPLE = {f.name: f.number for f in pb.LiveSample.DESCRIPTOR.fields}
_TENSOR = {f.name: f.number for f in pb.Tensor.DESCRIPTOR.fields}
_TURN = {f.name: f.number for f in pb.Turn.DESCRIPTOR.fields}


@dataclass
class WireTensor:
    """A `Tensor`'s fields; `data` a view of the request's bytes."""

    dtype: str = ""
    shape: list[int] = field(default_factory=list)
    data: memoryview = memoryview(b"")


@dataclass
class WireTurn:
    """A `Turn`'s fields."""

    role: int = 0
    tokens: int = 0
    images: int = 0


@dataclass
class WireSample:
    """A `LiveSample`'s fields; its tensors' data and its images views of the request's bytes."""

    id: str = ""
    tokens: WireTensor = field(default_factory=WireTensor)
    loss_mask: WireTensor | None = None
    tensors: dict[str, WireTensor] = field(default_factory=dict)
    group: str = ""
    policy_version: int = 0
    prompt: str = ""
    images: list[memoryview] = field(default_factory=list)
    values: dict[str, float] = field(default_factory=dict)
    unfinished: bool = False
    part: int = 0
    token_versions: WireTensor | None = None
    turns: list[WireTurn] = field(default_factory=list)
    parent: str = ""
    fork_turn: int = 0

    def HasField(self, name: str) -> bool:  # noqa: N802 - the protobuf method the checks call
        return getattr(self, name) is not None


@dataclass
class PutRequest:
    """A `PutSamplesRequest`, read by `parse` (`FromString`, as the server's request parsing calls it)."""

    DESCRIPTOR = pb.PutSamplesRequest.DESCRIPTOR  # what its errors name
    job: str
    samples: list[WireSample]
    end: bool
    size: int  # of the request on the wire
    producer_token: str = ""
    producer: str = ""

    @classmethod
    def parse(cls, raw: bytes) -> PutRequest:
        """The request's fields, its payload in place (WireFormatError: not a well-formed PutSamplesRequest)."""
        view = memoryview(raw)
        job, samples, end, token, producer = "", [], False, "", ""
        for number, wire_type, _, value, value_end in fields(view, 0, len(view)):
            if number == _REQUEST["job"] and wire_type == LENGTH_DELIMITED:
                job = _text(view, value, value_end, "job")
            elif number == _REQUEST["samples"] and wire_type == LENGTH_DELIMITED:
                samples.append(_sample(view, value, value_end))
            elif number == _REQUEST["end"] and wire_type == VARINT:
                end = bool(value)
            elif number == _REQUEST["producer_token"] and wire_type == LENGTH_DELIMITED:
                token = _text(view, value, value_end, "producer_token")
            elif number == _REQUEST["producer"] and wire_type == LENGTH_DELIMITED:
                producer = _text(view, value, value_end, "producer")
        return cls(job, samples, end, len(raw), token, producer)

    FromString = parse

    def ByteSize(self) -> int:  # noqa: N802 - as a message answers it
        return self.size


def _sample(view: memoryview, start: int, end: int) -> WireSample:
    sample = WireSample()
    for number, wire_type, _, value, value_end in fields(view, start, end):
        delimited = wire_type == LENGTH_DELIMITED
        if number == _SAMPLE["id"] and delimited:
            sample.id = _text(view, value, value_end, "id")
        elif number == _SAMPLE["tokens"] and delimited:
            sample.tokens = _tensor(view, value, value_end)
        elif number == _SAMPLE["loss_mask"] and delimited:
            sample.loss_mask = _tensor(view, value, value_end)
        elif number == _SAMPLE["tensors"] and delimited:  # a map entry: key 1, value 2
            name, tensor = "", WireTensor()
            for entry, entry_type, _, entry_value, entry_end in fields(view, value, value_end):
                if entry == 1 and entry_type == LENGTH_DELIMITED:
                    name = _text(view, entry_value, entry_end, "tensors")
                elif entry == 2 and entry_type == LENGTH_DELIMITED:
                    tensor = _tensor(view, entry_value, entry_end)
            sample.tensors[name] = tensor
        elif number == _SAMPLE["group"] and delimited:
            sample.group = _text(view, value, value_end, "group")
        elif number == _SAMPLE["policy_version"] and wire_type == VARINT:
            sample.policy_version = signed64(value)
        elif number == _SAMPLE["prompt"] and delimited:
            sample.prompt = _text(view, value, value_end, "prompt")
        elif number == _SAMPLE["images"] and delimited:
            sample.images.append(view[value:value_end])
        elif number == _SAMPLE["values"] and delimited:  # a map entry: key 1 (string), value 2 (double)
            name, number_value = "", 0.0
            for entry, entry_type, _, entry_value, entry_end in fields(view, value, value_end):
                if entry == 1 and entry_type == LENGTH_DELIMITED:
                    name = _text(view, entry_value, entry_end, "values")
                elif entry == 2 and entry_type == FIXED64:
                    number_value = struct.unpack_from("<d", view, entry_value)[0]
            sample.values[name] = number_value
        elif number == _SAMPLE["unfinished"] and wire_type == VARINT:
            sample.unfinished = bool(value)
        elif number == _SAMPLE["part"] and wire_type == VARINT:
            sample.part = value & 0xFFFFFFFF
        elif number == _SAMPLE["token_versions"] and delimited:
            sample.token_versions = _tensor(view, value, value_end)
        elif number == _SAMPLE["turns"] and delimited:
            sample.turns.append(_turn(view, value, value_end))
        elif number == _SAMPLE["parent"] and delimited:
            sample.parent = _text(view, value, value_end, "parent")
        elif number == _SAMPLE["fork_turn"] and wire_type == VARINT:
            sample.fork_turn = value & 0xFFFFFFFF
    return sample


def _turn(view: memoryview, start: int, end: int) -> WireTurn:
    turn = WireTurn()
    for number, wire_type, _, value, _ in fields(view, start, end):
        if wire_type != VARINT:
            continue
        if number == _TURN["role"]:
            turn.role = signed64(value)
        elif number == _TURN["tokens"]:
            turn.tokens = value & 0xFFFFFFFF
        elif number == _TURN["images"]:
            turn.images = value & 0xFFFFFFFF
    return turn


def _tensor(view: memoryview, start: int, end: int) -> WireTensor:
    tensor = WireTensor()
    for number, wire_type, _, value, value_end in fields(view, start, end):
        if number == _TENSOR["dtype"] and wire_type == LENGTH_DELIMITED:
            tensor.dtype = _text(view, value, value_end, "dtype")
        elif number == _TENSOR["shape"]:
            tensor.shape += packed_varints(view, wire_type, value, value_end)
        elif number == _TENSOR["data"] and wire_type == LENGTH_DELIMITED:
            tensor.data = view[value:value_end]
    return tensor


def _text(view: memoryview, start: int, end: int, what: str) -> str:
    try:
        return str(view[start:end], "utf-8")
    except UnicodeDecodeError:
        raise WireFormatError(f"{what}: invalid UTF-8 in a string field") from None
