"""Shared-memory segments of the workers on the server's host.

A worker on the same host may carry its payloads in shared memory instead
of gRPC messages (as BytePS does with ``BYTEPS_ENABLE_IPC``). Each segment
is a memfd that the worker allocated and sealed against shrinking and
growing; its descriptor reaches the server over a Unix socket
(`_fdpass`), and the Attach RPC maps it for the worker's rank. The seals
and the allocation are checked, so a mapping can never fault (SIGBUS) and a
sparse segment cannot make the server allocate; segments count against the
server's memory budget and a per-rank cap. Segment ids are random and bound
to the rank (and job incarnation) that attached them.

A push names a slot, which the worker then lends to the server until its
pull of the round returns (the server may sum in it); the pull names the
same slot and finds the sum there.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import secrets
import stat

from ._wire import SHM_MAP_FLAGS as MAP_FLAGS
from ._wire import SHM_SEALS
from ._wire import Rejected as StoreError

#: Most segments one rank may have attached at once.
MAX_SEGMENTS = 4096
#: Most bytes of segments one rank may have attached at once.
MAX_RANK_BYTES = 1 << 30


class Segments:
    """The segments attached by each rank, by (rank, segment id).

    Args:
      budget: the server's memory budget (`_store.Budget`), which segments
        count against; None counts nothing.
      max_rank_bytes: most bytes of segments per rank.
    """

    def __init__(self, budget=None, max_rank_bytes: int = MAX_RANK_BYTES):
        self._maps: dict[tuple[int, int], mmap.mmap] = {}
        self._budget = budget
        self.max_rank_bytes = max_rank_bytes

    def attach(self, rank: int, fd: int, size: int) -> int:
        """Maps a worker's sealed memfd `fd` of `size` bytes (the caller
        closes `fd`); returns the segment's id, or raises StoreError."""
        what = f"shared-memory segment of rank {rank}"
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0
        if seals & SHM_SEALS != SHM_SEALS:
            raise StoreError(
                "FAILED_PRECONDITION",
                f"{what} is not a memfd sealed against shrinking and growing "
                "(F_SEAL_SHRINK | F_SEAL_GROW): it could change size under "
                "the server.",
            )
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size or size < 1:
            raise StoreError(
                "FAILED_PRECONDITION",
                f"{what} has {info.st_size} bytes, not the {size} its Attach "
                "says.",
            )
        if info.st_blocks * 512 < size:
            raise StoreError(
                "FAILED_PRECONDITION",
                f"{what} is sparse ({info.st_blocks * 512} of {size} bytes "
                "allocated): allocate it (posix_fallocate) before Attach.",
            )
        mine = [m for (r, _), m in self._maps.items() if r == rank]
        held = sum(len(m) for m in mine)
        if len(mine) >= MAX_SEGMENTS or held + size > self.max_rank_bytes:
            raise StoreError(
                "RESOURCE_EXHAUSTED",
                f"{what}: rank {rank} has {len(mine)} segments of "
                f"{held >> 20} MiB attached; the most are {MAX_SEGMENTS} "
                f"and {self.max_rank_bytes >> 20} MiB per rank.",
            )
        if self._budget is not None:
            self._budget.reserve(size, what)
        try:
            segment = mmap.mmap(fd, size, flags=MAP_FLAGS)
        except OSError as err:
            if self._budget is not None:
                self._budget.release(size)
            raise StoreError(
                "FAILED_PRECONDITION", f"cannot map {what}: {err}"
            ) from None
        while True:
            sid = secrets.randbits(32)
            if (rank, sid) not in self._maps:
                break
        self._maps[(rank, sid)] = segment
        return sid

    def detach(self, rank: int, ids) -> None:
        """Unmaps segments of `rank` (unknown ids are ignored)."""
        for i in ids:
            segment = self._maps.pop((rank, i), None)
            if segment is not None:
                self._unmap(segment)

    def _unmap(self, segment: mmap.mmap) -> None:
        if self._budget is not None:
            self._budget.release(len(segment))
        _close(segment)

    def view(self, rank: int, segment: int, offset: int, nbytes: int):
        """The `nbytes` at `offset` of a segment, as a writable memoryview."""
        mapped = self._maps.get((rank, segment))
        if mapped is None:
            raise StoreError(
                "FAILED_PRECONDITION",
                f"rank {rank} named shared-memory segment {segment}, which "
                "it never attached to this server in this job incarnation "
                "(was the server restarted?).",
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
            self._unmap(segment)
        self._maps.clear()


def _close(segment: mmap.mmap) -> None:
    try:
        segment.close()
    except BufferError:
        pass  # a view is still in use; the mapping goes with it
