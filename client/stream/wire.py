"""Reading a `Pack` message without copying its tensor payload.

`Pack.FromString` copies every bytes field into the message, and reading `.data` copies it again, so a
client would touch each pixel three times after gRPC hands it the message. Here only the small fields go
through protobuf; the `tensors` map entries are located by the wire format's rules (`packfeed.v1.wire_format`)
and each tensor becomes a numpy view of the received bytes at its offset. Numpy only: usable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from packfeed.v1 import packfeed_pb2 as pb
from packfeed.v1.wire_format import LENGTH_DELIMITED as _LENGTH_DELIMITED
from packfeed.v1.wire_format import VARINT as _VARINT
from packfeed.v1.wire_format import WireFormatError, packed_varints
from packfeed.v1.wire_format import fields as _fields

_TENSORS = pb.Pack.DESCRIPTOR.fields_by_name["tensors"].number
_DTYPE, _SHAPE, _DATA = (pb.Tensor.DESCRIPTOR.fields_by_name[n].number for n in ("dtype", "shape", "data"))
_PART_DATA, _PART_LAST, _PART_WAITING = (pb.PackPart.DESCRIPTOR.fields_by_name[n].number
                                         for n in ("data", "last", "waiting"))


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
        elif number == _SHAPE:  # packed or not: both legal
            shape += packed_varints(buf, wire_type, value, value_end)
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
        self.waiting: pb.LiveStatus | None = None  # the last live job state a waiting stream sent (PackPart.waiting)

    def add(self, part: bytes) -> bytes | None:
        data, last = memoryview(b""), False
        for number, wire_type, _, value, value_end in _fields(part, 0, len(part)):
            if number == _PART_DATA and wire_type == _LENGTH_DELIMITED:
                data = memoryview(part)[value:value_end]
            elif number == _PART_LAST and wire_type == _VARINT:
                last = bool(value)
            elif number == _PART_WAITING and wire_type == _LENGTH_DELIMITED:
                self.waiting = pb.LiveStatus.FromString(bytes(part[value:value_end]))
        self._pieces.append(data)
        if not last:
            return None
        whole, self._pieces = b"".join(self._pieces), []
        return whole

    @property
    def partial(self) -> bool:
        """A pack has begun but not ended (a broken stream drops it and asks again)."""
        return bool(self._pieces)
