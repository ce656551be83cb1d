"""Hand-rolled protobuf encoding of the two messages that carry payloads.

`PushRequest` and `PullReply` are encoded exactly as protoc's code would
encode them (so any protobuf client can talk to a server), but the payload is
copied once, straight from the numpy array into the message, and decoded as a
zero-copy memoryview of the received bytes. A payload in shared memory
travels as a `ShmSlot` instead.
"""

from __future__ import annotations

import struct

import numpy as np

from . import jaxps_pb2 as pb

_LEN = 2  # wire type of length-delimited fields
_I32 = 5  # wire type of fixed32 fields
_VARINT = 0
_I64 = 1


class DecodeError(ValueError):
    """A message is not a well-formed protobuf encoding."""


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise DecodeError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise DecodeError("varint longer than 10 bytes")


def _fields(data) -> dict[int, object]:
    """Top-level fields of a message: number -> memoryview or int."""
    buf = memoryview(data).cast("B")
    pos, out = 0, {}
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise DecodeError("field number 0")
        if wire == _LEN:
            size, pos = _read_varint(buf, pos)
            if pos + size > len(buf):
                raise DecodeError(
                    f"field {number} declares {size} bytes, only "
                    f"{len(buf) - pos} left"
                )
            out[number] = buf[pos : pos + size]
            pos += size
        elif wire == _VARINT:
            out[number], pos = _read_varint(buf, pos)
        elif wire == _I32:
            if pos + 4 > len(buf):
                raise DecodeError(f"truncated fixed32 field {number}")
            out[number] = struct.unpack_from("<I", buf, pos)[0]
            pos += 4
        elif wire == _I64:
            if pos + 8 > len(buf):
                raise DecodeError(f"truncated fixed64 field {number}")
            out[number] = struct.unpack_from("<Q", buf, pos)[0]
            pos += 8
        else:
            raise DecodeError(f"unsupported wire type {wire}")
    return out


def _bytes_view(payload) -> memoryview:
    if isinstance(payload, np.ndarray):  # also dtypes without a buffer format
        payload = payload.reshape(-1).view(np.uint8)
    return memoryview(payload).cast("B")


def _message(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | _LEN) + _varint(len(value)) + value


def encode_push(
    header: pb.Header, payload, checksum: int, slot: pb.ShmSlot | None = None
) -> bytes:
    """Encodes a PushRequest; `payload` is any C-contiguous buffer.

    With a `slot`, the payload is already there and is not sent.
    """
    prefix = (
        _message(1, header.SerializeToString())
        + _varint(3 << 3 | _I32)
        + struct.pack("<I", checksum)
    )
    if slot is not None:
        return prefix + _message(4, slot.SerializeToString())
    view = _bytes_view(payload)
    prefix += _varint(2 << 3 | _LEN) + _varint(len(view))
    return b"".join((prefix, view))


def decode_push(
    data,
) -> tuple[pb.Header, memoryview, int, pb.ShmSlot | None]:
    """Decodes a PushRequest: (header, payload view, checksum, slot)."""
    fields = _fields(data)
    header = _header(fields.get(1))
    payload = fields.get(2, memoryview(b""))
    if not isinstance(payload, memoryview):
        raise DecodeError("payload is not length-delimited")
    checksum = fields.get(3, 0)
    if not isinstance(checksum, int):
        raise DecodeError("checksum is not a fixed32")
    slot = fields.get(4)
    if slot is not None:
        if not isinstance(slot, memoryview):
            raise DecodeError("slot is not a message")
        try:
            slot = pb.ShmSlot.FromString(bytes(slot))
        except Exception as err:  # protobuf's DecodeError
            raise DecodeError(f"slot: {err}") from None
    return header, payload, checksum, slot


def encode_pull_reply(
    incarnation: str, payload, in_slot=False, contributors: int = 0
) -> bytes:
    """Encodes a PullReply; `payload` is any C-contiguous buffer;
    `contributors`: how many ranks the sum is over (0: not said)."""
    prefix = _message(1, incarnation.encode())
    if contributors:
        prefix += _varint(4 << 3 | _VARINT) + _varint(contributors)
    if in_slot:
        return prefix + _varint(3 << 3 | _VARINT) + _varint(1)
    view = _bytes_view(payload)
    prefix += _varint(2 << 3 | _LEN) + _varint(len(view))
    return b"".join((prefix, view))


def decode_pull_reply(data) -> tuple[str, memoryview, bool, int]:
    """Decodes a PullReply: (incarnation, payload view, in_slot,
    contributors)."""
    fields = _fields(data)
    incarnation = fields.get(1, memoryview(b""))
    payload = fields.get(2, memoryview(b""))
    in_slot = fields.get(3, 0)
    contributors = fields.get(4, 0)
    if (
        not isinstance(incarnation, memoryview)
        or not isinstance(payload, memoryview)
        or not isinstance(in_slot, int)
        or not isinstance(contributors, int)
    ):
        raise DecodeError("PullReply fields have the wrong wire type")
    if contributors >= 1 << 32:
        raise DecodeError(f"contributors {contributors} is not a uint32")
    return (
        bytes(incarnation).decode(errors="replace"),
        payload,
        bool(in_slot),
        contributors,
    )


def _header(raw) -> pb.Header:
    if raw is None:
        raise DecodeError("header is missing")
    if not isinstance(raw, memoryview):
        raise DecodeError("header is not a message")
    try:
        return pb.Header.FromString(bytes(raw))
    except Exception as err:  # protobuf's DecodeError
        raise DecodeError(f"header: {err}") from None
