"""The wire contract: everything the server and the workers agree on.

The worker side imports nothing else from ``jaxps.servers`` but this module,
the generated messages (``jaxps_pb2``) and their payload codec (``_codec``):
service and metadata names, channel options, the server's ready line, the
shared-memory constants, the dtype codes and keys, and `Rejected`, the
gRPC-neutral form of a refused request.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import hmac
import mmap
import socket
import ssl
import struct
import zlib

import numpy as np

from . import jaxps_pb2 as pb

#: 4: call checks (Header.signature), Join and the contributors of a sum;
#: 5: call checks carried by a piece (Header.check_key); 6: payloads in
#: shared-memory slots named on the data channel (DATA_OP_IN_SLOT).
PROTOCOL_VERSION = 6
#: The gRPC service of a summation server (also its health-check name).
SERVICE_NAME = "jaxps.Summation"
#: Trailing metadata of every rejection: the server's incarnation id, so a
#: worker tells "rejected" from "rejected by a restarted server".
INCARNATION_KEY = "jaxps-incarnation"
#: Metadata key that carries the job's shared token.
TOKEN_KEY = "jaxps-token"
#: A server prints this, then ``HOST:PORT``, once it is listening.
READY_PREFIX = "jaxps-server listening on "

#: Bytes of the cookie that names a segment's memfd sent over the server's
#: Unix socket (then named again by the Attach RPC).
SHM_COOKIE_BYTES = 16
#: Seals a segment's memfd must carry: it can never change size, so a
#: mapping of it can never fault (no SIGBUS).
SHM_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
#: Shared mapping, with its page tables filled at once (no faults later).
SHM_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)

CHUNK_BITS = 16
MAX_CHUNKS = 1 << CHUNK_BITS
#: Room on top of a chunk for the header fields of one message.
MESSAGE_OVERHEAD = 64 * 1024


class Rejected(Exception):
    """A request the server refuses; `code` names the gRPC status to send
    (``"INVALID_ARGUMENT"``, ``"ABORTED"``, ...)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC options shared by servers and worker channels."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Keepalive finds peers that vanish without closing the connection.
        # Not tighter: on a busy slow link a ping's answer queues behind
        # megabytes of payload, and a healthy connection would be dropped.
        # Frozen peers are found sooner by every call's deadline.
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.http2.ping_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ]


_NAMES = {
    pb.FLOAT32: "float32",
    pb.FLOAT64: "float64",
    pb.FLOAT16: "float16",
    pb.BFLOAT16: "bfloat16",
    pb.INT32: "int32",
    pb.INT64: "int64",
}
#: The names of the dtypes jaxps sends.
SUPPORTED_DTYPES = tuple(_NAMES.values())


#: Every dtype but bfloat16, whose numpy type comes from ml_dtypes: that
#: costs a second to import, so a server never sent bfloat16 starts
#: without it (the workers have it through jax).
_PLAIN = {
    code: np.dtype(name) for code, name in _NAMES.items() if name != "bfloat16"
}
_PLAIN_CODES = {dt: code for code, dt in _PLAIN.items()}


@functools.cache
def _bfloat16() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def supported_dtypes() -> tuple[np.dtype, ...]:
    """The numpy dtypes jaxps sends."""
    return tuple(code_dtype(code) for code in _NAMES)


def dtype_code(dtype) -> int:
    """Returns the wire code of a numpy dtype, or raises ``TypeError``."""
    dt = np.dtype(dtype).newbyteorder("=")
    code = _PLAIN_CODES.get(dt)
    if code is not None:
        return code
    if dt.name == "bfloat16" and dt == _bfloat16():
        return pb.BFLOAT16
    raise TypeError(
        f"jaxps cannot send dtype {dt}; supported dtypes are "
        f"{', '.join(SUPPORTED_DTYPES)}."
    )


def code_dtype(code: int) -> np.dtype:
    """Returns the numpy dtype of a wire code, or raises ``KeyError``."""
    dt = _PLAIN.get(code)
    if dt is not None:
        return dt
    if code == pb.BFLOAT16:
        return _bfloat16()
    raise KeyError(code)


def dtype_name(code: int) -> str:
    """Names a wire dtype code for messages, also when it is unknown."""
    return _NAMES.get(code, f"unknown dtype code {code}")


def make_key(tensor_id: int, chunk: int) -> int:
    """Packs a 48-bit tensor id and a 16-bit chunk index into one key."""
    if not 0 <= chunk < MAX_CHUNKS:
        raise ValueError(
            f"chunk index {chunk} out of range [0, {MAX_CHUNKS}); increase "
            "partition_bytes."
        )
    return ((tensor_id & ((1 << 48) - 1)) << CHUNK_BITS) | chunk


def checksum(payload) -> int:
    """Returns the crc32 of a payload (bytes or a buffer)."""
    return zlib.crc32(payload) & 0xFFFFFFFF


#: A fingerprint covers this many bytes at each end of a payload.
FINGERPRINT_BYTES = 4096


def fingerprint(payload) -> int:
    """The checksum a push carries: crc32 of a payload's first and last
    4 KiB, and its length (all of it if it is small). It tells a retry from
    a conflicting duplicate, and the server checks it against the payload
    it received (a full crc32 would cost ~0.3 cpu-s/GB, as much as the sum).
    """
    return fingerprint_parts((payload,))


def fingerprint_parts(parts, total: int | None = None) -> int:
    """`fingerprint` of the payload that `parts` (buffers or arrays) make in
    turn, of `total` bytes (default: counted), touching only the parts its
    ends are in (a fused piece may have hundreds)."""
    parts = list(parts)
    if total is None:
        total = sum(_nbytes(p) for p in parts)
    if total <= 2 * FINGERPRINT_BYTES:
        views = [_bytes(p) for p in parts]
        return checksum(views[0] if len(views) == 1 else b"".join(views))
    return (
        checksum(_ends(parts, FINGERPRINT_BYTES))
        ^ checksum(_ends(reversed(parts), FINGERPRINT_BYTES, tail=True))
        ^ total
    )


def _nbytes(part) -> int:
    return part.nbytes if isinstance(part, np.ndarray) else len(_bytes(part))


def _bytes(part) -> memoryview:
    """`part` as a flat byte view (arrays too, of dtypes without a buffer
    format such as bfloat16)."""
    if isinstance(part, np.ndarray):
        part = part.reshape(-1).view(np.uint8)
    return memoryview(part).cast("B")


def _ends(parts, nbytes: int, tail: bool = False):
    """The first `nbytes` of `parts` in turn (with `tail`: the last, where
    `parts` come last first)."""
    taken, left = [], nbytes
    for part in parts:
        if not left:
            break
        view = _bytes(part)
        piece = view[-left:] if tail else view[:left]
        if piece:
            taken.append(piece)
            left -= len(piece)
    if len(taken) == 1:  # within one buffer: no copy
        return taken[0]
    return b"".join(reversed(taken) if tail else taken)


# -- the data channel ---------------------------------------------------------
#
# Bulk payloads to a server on another host may travel on plain TCP instead
# of gRPC messages. The server offers the channel in its HelloReply (a port
# and a one-time nonce); the worker connects and sends DATA_HELLO, whose mac
# is HMAC-SHA256 under the job's token (an empty key without one) of the
# nonce, the rank and the job id. The server answers with a DATA_REPLY (kind
# DATA_OK, body: its incarnation) or an error and closes. Then each request
# is a DATA_REQUEST, the chunk's name (utf-8) and its payload; the server
# answers DATA_ACK once the push is accepted and DATA_SUM with the sum (and
# the number of ranks it is over) once the round is complete, or DATA_ERROR
# with a message at any point. A DATA_SUM or DATA_ERROR also acknowledges
# the push: a push from a slot whose round it completed may get the
# DATA_SUM alone. A call check (Header.signature) is a DATA_OP_CHECK
# request whose name is `encode_check_name` of its signature, call name and
# description; a piece that carries one (Header.check_key) is a
# DATA_OP_PUSH_PULL_CHECKED request whose name is `encode_carrier_name`.
# A worker on the server's host may leave a push's payload in a slot of its
# shared memory (attached over gRPC): the op then has DATA_OP_IN_SLOT set,
# a DATA_SLOT (segment id, byte offset) follows the name instead of the
# payload, and the DATA_SUM has no body: the sum is in the slot.

DATA_MAGIC = b"JXPD"
#: magic, protocol version, rank, nonce, mac.
DATA_HELLO = struct.Struct("<4sII16s32s")
#: op, dtype code, name bytes, rank, key, round, length (elements),
#: checksum, request id, seconds the worker waits for the sum.
DATA_REQUEST = struct.Struct("<BBHIQQQIId")
#: kind, status code (`STATUS_CODES` index), contributors (how many ranks
#: a DATA_SUM is over; else 0), request id, body bytes.
DATA_REPLY = struct.Struct("<BBxxIIQ")
DATA_OP_PUSH_PULL = 1
DATA_OP_CHECK = 2
DATA_OP_PUSH_PULL_CHECKED = 3
DATA_OPS = (DATA_OP_PUSH_PULL, DATA_OP_CHECK, DATA_OP_PUSH_PULL_CHECKED)
#: Flag of a push_pull op whose payload is in a shared-memory slot.
DATA_OP_IN_SLOT = 0x80
#: segment id, byte offset (as `pb.ShmSlot`).
DATA_SLOT = struct.Struct("<IQ")
_SIGNATURE = struct.Struct("<Q")
#: signature, check key, check round, bytes of the name and of the call
_CARRIED = struct.Struct("<QQQII")
DATA_OK, DATA_ACK, DATA_SUM, DATA_ERROR = 0, 1, 2, 3
DATA_NONCE_BYTES = 16
#: SO_SNDBUF of both ends of a data connection. Autotuned buffers of many
#: flows into one link overflow its queue (drops, retransmits): on the
#: emulated cluster (4,4) a cap of 128 KiB took 1 Gbit/s from 0.40 to
#: 0.29 s and 100 Mbit/s from 2.47 to 2.26 s; 512 KiB gave 0.31 and 2.29,
#: and 0.68 against 0.61 s at 400 Mbit/s (benchmarks/README.md).
DATA_SNDBUF = 128 * 1024
#: Longest error message or chunk name on the data channel.
DATA_MAX_TEXT = 1 << 16

#: gRPC status names by their numeric code (the data channel sends codes).
STATUS_CODES = (
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
)


#: Starts the message of a call check that found ranks pushing different
#: trees under one name (a worker raises `MismatchError` for it).
MISMATCH_PREFIX = "push_pull mismatch: "
#: In a Hello's refusal: another process claimed the rank (`_jobs`).
CLAIM_CONFLICT = "two processes claim rank"

#: Status codes that mean "the server refused this request" (a worker
#: raises RequestRejectedError for them, on gRPC and the data channel).
REJECTED_STATUSES = frozenset(
    {
        "INVALID_ARGUMENT",
        "ABORTED",
        "FAILED_PRECONDITION",
        "PERMISSION_DENIED",
        "UNAUTHENTICATED",
        "RESOURCE_EXHAUSTED",
        "OUT_OF_RANGE",
    }
)


def encode_check_name(signature: int, name: str, description: str) -> bytes:
    """The name field of a DATA_OP_CHECK request: the signature (8 bytes),
    then utf-8 ``name``, NUL, ``description``, cut to `DATA_MAX_TEXT`."""
    text = f"{name}\0{description}".encode()
    return (_SIGNATURE.pack(signature) + text)[: DATA_MAX_TEXT - 1]


def decode_check_name(raw: bytes) -> tuple[int, str, str]:
    """(signature, name, description) of a DATA_OP_CHECK name field."""
    if len(raw) < _SIGNATURE.size:
        return 0, raw.decode(errors="replace"), ""
    (signature,) = _SIGNATURE.unpack_from(raw)
    text = raw[_SIGNATURE.size :].decode(errors="replace")
    name, _, description = text.partition("\0")
    return signature, name, description


def encode_carrier_name(header) -> bytes:
    """The name field of a DATA_OP_PUSH_PULL_CHECKED request: the
    signature, check key and check round (8 bytes each), the byte lengths
    of ``name`` and ``check_call`` (4 bytes each), then utf-8 ``name``,
    ``check_call`` and ``description``, cut to `DATA_MAX_TEXT`."""
    name = header.name.encode()[: DATA_MAX_TEXT // 4]
    call = header.check_call.encode()[: DATA_MAX_TEXT // 4]
    head = _CARRIED.pack(
        header.signature,
        header.check_key,
        header.check_round,
        len(name),
        len(call),
    )
    raw = head + name + call + header.description.encode()
    return raw[: DATA_MAX_TEXT - 1]


def decode_carrier_name(raw: bytes, header) -> None:
    """Sets ``name``, ``signature``, ``description``, ``check_key``,
    ``check_round`` and ``check_call`` of `header` from the name field of a
    DATA_OP_PUSH_PULL_CHECKED request."""
    if len(raw) < _CARRIED.size:
        raise Rejected(
            "INVALID_ARGUMENT",
            f"data frame: a carried call check of {len(raw)} bytes",
        )
    (
        header.signature,
        header.check_key,
        header.check_round,
        name_len,
        call_len,
    ) = _CARRIED.unpack_from(raw)
    at = _CARRIED.size
    if at + name_len + call_len > len(raw):
        raise Rejected(
            "INVALID_ARGUMENT",
            f"data frame: a carried call check names {name_len} + "
            f"{call_len} bytes in {len(raw) - at}",
        )
    text = raw[at:]
    header.name = text[:name_len].decode(errors="replace")
    header.check_call = text[name_len : name_len + call_len].decode(
        errors="replace"
    )
    header.description = text[name_len + call_len :].decode(errors="replace")


def data_mac(token: str | None, nonce: bytes, rank: int, job_id: str) -> bytes:
    """The mac of a data-channel hello (HMAC-SHA256)."""
    msg = nonce + struct.pack("<I", rank) + job_id.encode()
    return hmac.new((token or "").encode(), msg, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fills `view` from a blocking socket, plain or TLS (one ``recv_into``
    in the common case); raises ConnectionError if the peer closes first."""
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL
    while len(view):
        n = sock.recv_into(view, len(view), flags)
        if n == 0:
            raise ConnectionError("the peer closed the data connection")
        view = view[n:]


#: Most buffers one ``sendmsg`` takes (Linux's IOV_MAX).
SEND_VECTORS = 1024


def _views(parts) -> list[memoryview]:
    views = []
    for part in parts:
        if isinstance(part, np.ndarray):  # also dtypes without a format
            part = part.reshape(-1).view(np.uint8)
        views.append(memoryview(part).cast("B"))
    return views


def send_now(sock: socket.socket, *parts) -> tuple[memoryview, ...]:
    """Sends what of `parts` (as `send_frame`'s; None is skipped) a plain
    socket takes without blocking, with one ``sendmsg``; returns the
    parts left to send (empty once all went)."""
    views = _views(p for p in parts if p is not None)
    try:
        sent = sock.sendmsg(views, [], socket.MSG_DONTWAIT)
    except BlockingIOError:
        return tuple(views)
    left = []
    for view in views:
        if sent >= len(view):
            sent -= len(view)
        else:
            left.append(view[sent:])
            sent = 0
    return tuple(left)


def send_frame(sock: socket.socket, *parts) -> None:
    """Sends `parts` (bytes, memoryviews or arrays) in order, with as few
    system calls as possible: one ``sendmsg`` on a plain socket (per
    `SEND_VECTORS` parts); on TLS, the small head (the first part) in one
    record and the payload straight after (its parts joined where there
    are several: encrypting copies them anyway, and each ``sendall`` of a
    small part would be a record of its own)."""
    views = _views(parts)
    if isinstance(sock, ssl.SSLSocket):
        head, *body = views
        sock.sendall(head)
        if body:
            sock.sendall(body[0] if len(body) == 1 else b"".join(body))
        return
    for first in range(0, len(views), SEND_VECTORS):
        batch = views[first : first + SEND_VECTORS]
        sent = sock.sendmsg(batch)
        for view in batch:  # the rest of a partial send
            if sent >= len(view):
                sent -= len(view)
                continue
            sock.sendall(view[sent:])
            sent = 0
