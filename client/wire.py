"""Reading a `Pack` message without copying its tensor payload.

`Pack.FromString` copies every bytes field into the message, and reading `.data` copies it again, so a
client would touch each pixel three times after gRPC hands it the message. Here only the small fields go
through protobuf; the `tensors` map entries are located by the wire format's rules (tag, varint length,
payload) and each tensor becomes a numpy view of the received bytes at its offset. Numpy only: usable
without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from packfeed.v1 import packfeed_pb2 as pb

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5
_TENSORS = pb.Pack.DESCRIPTOR.fields_by_name["tensors"].number
_DTYPE, _SHAPE, _DATA = (pb.Tensor.DESCRIPTOR.fields_by_name[n].number for n in ("dtype", "shape", "data"))
_PART_DATA, _PART_LAST = (pb.PackPart.DESCRIPTOR.fields_by_name[n].number for n in ("data", "last"))


class WireFormatError(ValueError):
    """The bytes are not a well-formed `packfeed.v1.Pack`."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise WireFormatError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise WireFormatError("varint longer than 10 bytes")


def _fields(buf: bytes, pos: int, end: int):
    """(field number, wire type, field start, value start, value end) of each field in buf[pos:end]; a varint
    field's value is (value, None, end of field)."""
    while pos < end:
        field_start = pos
        tag, pos = _varint(buf, pos)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == _VARINT:
            value, pos = _varint(buf, pos)
            yield number, wire_type, field_start, value, pos
            continue
        if wire_type == _LENGTH_DELIMITED:
            length, pos = _varint(buf, pos)
            start, pos = pos, pos + length
        elif wire_type in (_FIXED64, _FIXED32):
            start, pos = pos, pos + (8 if wire_type == _FIXED64 else 4)
        else:
            raise WireFormatError(f"unsupported wire type {wire_type} in field {number}")
        if pos > end:
            raise WireFormatError(f"field {number} runs past the end of the message")
        yield number, wire_type, field_start, start, pos


@dataclass(frozen=True)
class WireArray:
    dtype: np.dtype  # little-endian
    shape: tuple[int, ...]
    offset: int  # of the data in the message
    nbytes: int


def _tensor(buf: bytes, start: int, end: int) -> WireArray:
    dtype, shape, offset, nbytes = "", [], end, 0
    for number, wire_type, _, value, value_end in _fields(buf, start, end):
        if number == _DTYPE:
            dtype = bytes(buf[value:value_end]).decode()
        elif number == _SHAPE and wire_type == _VARINT:  # unpacked encoding, also legal
            shape.append(value)
        elif number == _SHAPE:
            pos = value
            while pos < value_end:
                dim, pos = _varint(buf, pos)
                shape.append(dim)
        elif number == _DATA:
            offset, nbytes = value, value_end - value
    try:
        little = np.dtype(dtype).newbyteorder("<")
    except TypeError:
        raise WireFormatError(f"unknown tensor dtype {dtype!r}") from None
    if int(np.prod(shape, dtype=np.int64)) * little.itemsize != nbytes:
        raise WireFormatError(f"tensor of shape {tuple(shape)} and dtype {dtype} cannot hold {nbytes} bytes")
    return WireArray(little, tuple(shape), offset, nbytes)


def split_pack(message: bytes) -> tuple[pb.Pack, dict[str, WireArray]]:
    """The message's fields except `tensors` (parsed by protobuf) and where each tensor lies in `message`."""
    others, tensors = [], {}
    for number, wire_type, field_start, start, end in _fields(message, 0, len(message)):
        if number != _TENSORS or wire_type != _LENGTH_DELIMITED:
            others.append(message[field_start:end])
            continue
        name, array = "", None
        for entry_field, _, _, value, value_end in _fields(message, start, end):
            if entry_field == 1:
                name = bytes(message[value:value_end]).decode()
            elif entry_field == 2:
                array = _tensor(message, value, value_end)
        tensors[name] = array if array is not None else WireArray(np.dtype("<u1"), (0,), 0, 0)
    return pb.Pack.FromString(b"".join(others)), tensors


def array_of(message: bytes, wire: WireArray) -> np.ndarray:
    """A read-only numpy view of one tensor inside the message bytes, native byte order (copied only on a
    big-endian machine)."""
    count = wire.nbytes // wire.dtype.itemsize
    if count == 0:
        return np.empty(wire.shape, dtype=wire.dtype.newbyteorder("="))
    array = np.frombuffer(message, dtype=wire.dtype, count=count, offset=wire.offset).reshape(wire.shape)
    return array if wire.dtype.isnative else array.astype(wire.dtype.newbyteorder("="))


class PackAssembler:
    """Joins the `PackPart` messages of StreamPackParts back into serialized `Pack`s: `add` returns a pack's
    bytes when its last part arrives, else None."""

    def __init__(self) -> None:
        self._pieces: list[memoryview] = []

    def add(self, part: bytes) -> bytes | None:
        data, last = memoryview(b""), False
        for number, wire_type, _, value, value_end in _fields(part, 0, len(part)):
            if number == _PART_DATA and wire_type == _LENGTH_DELIMITED:
                data = memoryview(part)[value:value_end]
            elif number == _PART_LAST and wire_type == _VARINT:
                last = bool(value)
        self._pieces.append(data)
        if not last:
            return None
        whole, self._pieces = b"".join(self._pieces), []
        return whole

    @property
    def partial(self) -> bool:
        """A pack has begun but not ended (a broken stream drops it and asks again)."""
        return bool(self._pieces)
