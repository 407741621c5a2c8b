"""Serializing a `Pack` message with one copy of its tensor payload.

Building the message through protobuf copies every tensor's bytes four times (ndarray -> bytes, into a
`Tensor`, into the map, out again on `SerializeToString`), which costs a loader server more than a third
of its time next to decoding and tiling. Protobuf messages concatenate: the fields without tensors are
serialized by protobuf, and each `tensors` map entry is framed here by the wire format's rules (a
length-delimited field is tag, varint length, payload), with the array's own buffer as the payload (for a
pack's pixels, `Chunks`: each tile's buffer in turn, never joined), so writing the pieces into a step's file
copies the pixels once. Any protobuf parser reads the result as the same `Pack`. Each payload
starts at a multiple of 64 bytes within the message (the Tensor's `align` padding), so readers in any
language can view it in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from packfeed.server.serve.packs import Chunks, Pack
from packfeed.v1 import packfeed_pb2 as pb

_LENGTH_DELIMITED = 2
_TENSORS = pb.Pack.DESCRIPTOR.fields_by_name["tensors"].number
_DATA = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number
_ALIGN = pb.Tensor.DESCRIPTOR.fields_by_name["align"].number
ALIGNMENT = 64  # bytes: tensor payloads start at multiples of this within the Pack message
_MAP_KEY, _MAP_VALUE = 1, 2  # protobuf's map entry: message { K key = 1; V value = 2; }
_PART_DATA = pb.PackPart.DESCRIPTOR.fields_by_name["data"].number
_PART_LAST = pb.PackPart.DESCRIPTOR.fields_by_name["last"].number


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _header(field_number: int, length: int) -> bytes:
    return _varint(field_number << 3 | _LENGTH_DELIMITED) + _varint(length)


def little_endian(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array)
    return array.astype(array.dtype.newbyteorder("<"), copy=False)


def _tensor_entry(name: str, array: np.ndarray | Chunks, offset: int, alignment: int) -> list:
    """The map entry of one tensor, to be written at `offset` of the message: its payload padded (the Tensor's
    `align` field, before `data`) to start at a multiple of `alignment` (1: no padding). The payload is the
    array's own buffer (each of its arrays' in turn, for `Chunks`)."""
    arrays = [little_endian(part) for part in (array.arrays if isinstance(array, Chunks) else (array,))]
    data = [memoryview(part).cast("B") for part in arrays if part.size]
    size = sum(len(part) for part in data)
    dtype, shape = (array.dtype, (len(array),)) if isinstance(array, Chunks) else (arrays[0].dtype, arrays[0].shape)
    key = name.encode()
    key_field = _header(_MAP_KEY, len(key)) + key
    shape = pb.Tensor(dtype=dtype.name, shape=shape).SerializeToString()
    padded, pad = size and alignment > 1, 0
    while True:  # grow the pad by what is missing; a varint growing with it may ask for one more round
        padding = _header(_ALIGN, pad) + bytes(pad) if padded else b""
        tensor_head = shape + padding + _header(_DATA, size)
        value_length = len(tensor_head) + size
        value_head = _header(_MAP_VALUE, value_length)
        entry_head = _header(_TENSORS, len(key_field) + len(value_head) + value_length)
        missing = -(offset + len(entry_head) + len(key_field) + len(value_head) + len(tensor_head)) % alignment
        if not padded or not missing:
            break
        pad += missing
    return [entry_head, key_field, value_head, tensor_head, *data]


def encode_pack(pack: Pack, microbatches: int, last_in_epoch: bool, alignment: int = ALIGNMENT) -> bytes:
    """The serialized `packfeed.v1.Pack` of `pack`; its tensors in `pack.tensors` order, so equal packs give
    equal bytes."""
    return b"".join(pack_pieces(pack, microbatches, last_in_epoch, alignment))


def pack_pieces(pack: Pack, microbatches: int, last_in_epoch: bool, alignment: int = ALIGNMENT) -> list:
    """The serialized `Pack` as pieces (bytes, and views of the tensors' own buffers) that concatenate to it:
    written one after another into any buffer, the pixels are copied once."""
    head = pb.Pack(epoch=pack.epoch, step=pack.step, rank=pack.rank, microbatch=pack.microbatch,
                   microbatches=microbatches, empty=pack.empty, last_in_epoch=last_in_epoch,
                   sample_keys=pack.sample_keys, sample_sources=pack.sample_sources, loss_tokens=pack.loss_tokens,
                   step_loss_tokens=pack.step_loss_tokens, encoder=pack.encoder,
                   sample_groups=pack.sample_groups,
                   skipped=[pb.SkippedSample(key=key, reason=reason, epoch=pack.epoch, step=pack.step)
                            for key, reason in pack.skipped])
    parts = [head.SerializeToString()]
    offset = len(parts[0])
    for name, array in pack.tensors.items():
        entry = _tensor_entry(name, array, offset, alignment)
        offset += sum(len(piece) for piece in entry)
        parts += entry
    return parts


@dataclass(frozen=True)
class SplitMessage:
    """A serialized message held as the buffers it lies in, in order (a worker cuts a pack's tiles straight into
    the step's shared file, away from the rest of the message): `bytes()` joins them, `pack_parts` cuts parts
    across them."""

    views: tuple[memoryview, ...]

    def __len__(self) -> int:
        return sum(len(view) for view in self.views)

    def __bytes__(self) -> bytes:
        return b"".join(self.views)


def pack_parts(message: bytes | memoryview | SplitMessage, part_bytes: int):
    """A serialized `Pack` as serialized `PackPart` messages carrying at most `part_bytes` of it each, in
    order, the final one with `last` set. Yields them one at a time: a part is copied only when sent."""
    views = [view for view in message.views if len(view)] if isinstance(message, SplitMessage) \
        else [memoryview(message)]
    total, last = sum(len(view) for view in views), _varint(_PART_LAST << 3) + b"\x01"
    start = 0
    while True:
        size = min(part_bytes, total - start)
        taken, missing = [], size
        while missing:  # the part's bytes, from as many views as it spans
            piece = views[0][:missing]
            taken.append(piece)
            missing -= len(piece)
            views[0] = views[0][len(piece):]
            if not len(views[0]):
                views.pop(0)
        start += size
        end = start >= total
        yield b"".join((_header(_PART_DATA, size), *taken, last if end else b""))
        if end:
            return
