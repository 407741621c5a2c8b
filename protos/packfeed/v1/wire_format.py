"""Protocol buffers' wire format, read by hand where protobuf would copy: a message's fields located by the format's
rules (tag, varint length, payload), so a large bytes field becomes a view of the received bytes instead of two
copies (`FromString` copies every bytes field into the message, and each read of it copies again). The client reads
packs this way (`packfeed.client.stream.wire`), the server a producer's put (`packfeed.server.live.put_request`)."""

from __future__ import annotations

from collections.abc import Iterator

VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5


class WireFormatError(ValueError):
    """The bytes are not a well-formed message of the type they are read as."""


def varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """(the varint at `pos`, the position after it)."""
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


def fields(buf: bytes | memoryview, pos: int, end: int) -> Iterator[tuple[int, int, int, int, int]]:
    """(field number, wire type, field start, value start, value end) of each field in buf[pos:end]; a varint
    field's value is (value, None, end of field)."""
    while pos < end:
        field_start = pos
        tag, pos = varint(buf, pos)
        number, wire_type = tag >> 3, tag & 7
        if wire_type == VARINT:
            value, pos = varint(buf, pos)
            yield number, wire_type, field_start, value, pos
            continue
        if wire_type == LENGTH_DELIMITED:
            length, pos = varint(buf, pos)
            start, pos = pos, pos + length
        elif wire_type in (FIXED64, FIXED32):
            start, pos = pos, pos + (8 if wire_type == FIXED64 else 4)
        else:
            raise WireFormatError(f"unsupported wire type {wire_type} in field {number}")
        if pos > end:
            raise WireFormatError(f"field {number} runs past the end of the message")
        yield number, wire_type, field_start, start, pos


def packed_varints(buf: bytes | memoryview, wire_type: int, value: int, value_end: int) -> list[int]:
    """A repeated integer field's values in one occurrence: packed (one length-delimited run) or not (one varint)."""
    if wire_type == VARINT:
        return [value]
    out, pos = [], value
    while pos < value_end:
        number, pos = varint(buf, pos)
        out.append(number)
    return out


def signed64(value: int) -> int:
    """An int64 field's varint as the signed number it encodes (two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value
