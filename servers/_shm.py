"""Shared-memory segments of the workers on the server's host.

A worker on the same host may carry its payloads in a file of ``/dev/shm``
instead of gRPC messages (as BytePS does with ``BYTEPS_ENABLE_IPC``). It
creates the file, writes a random token at its start and asks the server to
attach it; the server maps the file only if it is a regular file with the
expected name, size and token, i.e. one the worker itself just wrote. The
worker then unlinks the name: the memory lives as long as both mappings.

A push names a slot, which the worker then lends to the server until its
pull of the round returns (the server may sum in it); the pull names the
same slot and finds the sum there.
"""

from __future__ import annotations

import mmap
import os
import re
import stat

from ._wire import SHM_DIR as SHM_DIR
from ._wire import SHM_MAP_FLAGS as MAP_FLAGS
from ._wire import SHM_TOKEN_BYTES as TOKEN_BYTES
from ._wire import Rejected as StoreError

#: Names of segment files: "jaxps-" and 32 hex digits.
NAME = re.compile(r"jaxps-[0-9a-f]{32}")
#: Most segments one rank may have attached at once.
MAX_SEGMENTS = 4096


class Segments:
    """The segments attached by each rank, by (rank, segment id)."""

    def __init__(self):
        self._maps: dict[tuple[int, int], mmap.mmap] = {}
        self._next_id = 0

    def attach(self, rank: int, name: str, size: int, token: bytes) -> int:
        """Maps a worker's segment; returns its id, or raises StoreError."""
        if not NAME.fullmatch(name):
            raise StoreError(
                "INVALID_ARGUMENT",
                f"shared-memory segment name {name!r} of rank {rank} is not "
                "'jaxps-' followed by 32 hex digits.",
            )
        if len(token) != TOKEN_BYTES or size < TOKEN_BYTES:
            raise StoreError(
                "INVALID_ARGUMENT",
                f"attach of {name} by rank {rank}: need a {TOKEN_BYTES}-byte "
                f"token and a size >= {TOKEN_BYTES}, got {len(token)} and "
                f"{size}.",
            )
        if sum(r == rank for r, _ in self._maps) >= MAX_SEGMENTS:
            raise StoreError(
                "RESOURCE_EXHAUSTED",
                f"rank {rank} already attached {MAX_SEGMENTS} segments.",
            )
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as err:
            raise StoreError(
                "FAILED_PRECONDITION",
                f"cannot open shared-memory segment {path} of rank {rank} "
                f"({err.strerror}): the worker is not on this host.",
            ) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size != size:
                raise StoreError(
                    "FAILED_PRECONDITION",
                    f"shared-memory segment {path} of rank {rank} is not a "
                    f"regular file of {size} bytes.",
                )
            segment = mmap.mmap(fd, size, flags=MAP_FLAGS)
        finally:
            os.close(fd)
        if segment[:TOKEN_BYTES] != token:
            segment.close()
            raise StoreError(
                "FAILED_PRECONDITION",
                f"shared-memory segment {path} of rank {rank} does not hold "
                "the token the worker sent: it is not the worker's file.",
            )
        self._next_id += 1
        self._maps[(rank, self._next_id)] = segment
        return self._next_id

    def detach(self, rank: int, ids) -> None:
        """Unmaps segments of `rank` (unknown ids are ignored)."""
        for i in ids:
            segment = self._maps.pop((rank, i), None)
            if segment is not None:
                _close(segment)

    def view(self, rank: int, segment: int, offset: int, nbytes: int):
        """The `nbytes` at `offset` of a segment, as a writable memoryview."""
        mapped = self._maps.get((rank, segment))
        if mapped is None:
            raise StoreError(
                "FAILED_PRECONDITION",
                f"rank {rank} named shared-memory segment {segment}, which "
                "it never attached to this server (was it restarted?).",
            )
        if offset < 0 or nbytes < 0 or offset + nbytes > len(mapped):
            raise StoreError(
                "INVALID_ARGUMENT",
                f"slot [{offset}, {offset + nbytes}) of rank {rank} is "
                f"outside its segment {segment} of {len(mapped)} bytes.",
            )
        return memoryview(mapped)[offset : offset + nbytes]

    @property
    def attached_bytes(self) -> int:
        return sum(len(m) for m in self._maps.values())

    def close(self) -> None:
        for segment in self._maps.values():
            _close(segment)
        self._maps.clear()


def _close(segment: mmap.mmap) -> None:
    try:
        segment.close()
    except BufferError:
        pass  # a view is still in use; the mapping goes with it
