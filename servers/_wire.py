"""Constants and conversions shared by the server and the worker runtime."""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np

from . import jaxps_pb2 as pb

PROTOCOL_VERSION = 2
CHUNK_BITS = 16
MAX_CHUNKS = 1 << CHUNK_BITS
#: Room on top of a chunk for the header fields of one message.
MESSAGE_OVERHEAD = 64 * 1024

_BY_CODE = {
    pb.FLOAT32: np.dtype(np.float32),
    pb.FLOAT64: np.dtype(np.float64),
    pb.FLOAT16: np.dtype(np.float16),
    pb.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    pb.INT32: np.dtype(np.int32),
    pb.INT64: np.dtype(np.int64),
}
_BY_DTYPE = {dt: code for code, dt in _BY_CODE.items()}

#: The numpy dtypes jaxps sends, and their names.
DTYPES = tuple(_BY_CODE.values())
SUPPORTED_DTYPES = tuple(str(d) for d in DTYPES)


def dtype_code(dtype) -> int:
    """Returns the wire code of a numpy dtype, or raises ``TypeError``."""
    dt = np.dtype(dtype)
    try:
        return _BY_DTYPE[dt.newbyteorder("=")]
    except KeyError:
        raise TypeError(
            f"jaxps cannot send dtype {dt}; supported dtypes are "
            f"{', '.join(SUPPORTED_DTYPES)}."
        ) from None


def code_dtype(code: int) -> np.dtype:
    """Returns the numpy dtype of a wire code, or raises ``KeyError``."""
    return _BY_CODE[code]


def dtype_name(code: int) -> str:
    """Names a wire dtype code for messages, also when it is unknown."""
    dt = _BY_CODE.get(code)
    return str(dt) if dt is not None else f"unknown dtype code {code}"


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
