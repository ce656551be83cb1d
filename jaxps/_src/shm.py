"""Shared-memory slots that carry payloads to a server on the same host.

A `SlotPool` holds fixed-size slots in segments that one server attached
(the server side is `jaxps.servers._shm`). A chunk takes a slot, is copied
into it and pushed by reference; the slot is then the server's until the
chunk's pull (which names the same slot) returns with the sum in it, and it
is given back once the sum is copied out. Segments are added as needed up
to a limit; past it `take` returns None and the chunk goes through gRPC, so
a pool never waits (and never waits on other workers).
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import mmap
import os
import threading

import numpy as np

from jaxps.servers import _wire
from jaxps.servers import jaxps_pb2 as pb

log = logging.getLogger("jaxps")

#: Segments are added (and attached) about this many bytes at a time.
SEGMENT_BYTES = 16 * 1024 * 1024


def is_local(address: str) -> bool:
    """Whether a ``host:port`` is a loopback address (this host)."""
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Slot:
    """One slot: its place on the wire and its memory."""

    __slots__ = ("ref", "memory")

    def __init__(self, ref: pb.ShmSlot, memory: memoryview):
        self.ref = ref
        self.memory = memory

    def array(self, dtype, size: int) -> np.ndarray:
        """The first `size` elements of the slot as a writable array."""
        return np.frombuffer(self.memory, dtype, size)


class SlotPool:
    """Slots of `slot_bytes` in segments attached to one server.

    Args:
      attach: ``attach(fd, size) -> segment id`` (`ServerClient.attach`);
        raises if the server cannot map the sealed memfd `fd` (e.g. it is on
        another host).
      slot_bytes: size of every slot (the largest chunk).
      max_bytes: most memory of all segments together.
    """

    def __init__(self, attach, slot_bytes: int, max_bytes: int):
        self._attach = attach
        self.slot_bytes = slot_bytes
        self.slots_per_segment = max(1, SEGMENT_BYTES // slot_bytes)
        self.segment_bytes = slot_bytes * self.slots_per_segment
        self.max_segments = max_bytes // self.segment_bytes
        self._lock = threading.Lock()
        self._free: list[Slot] = []
        self._maps: list[mmap.mmap] = []
        self._views: list[memoryview] = []
        self.segment_ids: list[int] = []
        self.enabled = self.max_segments > 0

    def take(self, nbytes: int) -> Slot | None:
        """A free slot for `nbytes`, or None (then use gRPC payloads)."""
        if not self.enabled or nbytes > self.slot_bytes:
            return None
        with self._lock:
            if not self._free and len(self._maps) < self.max_segments:
                self._grow()
            return self._free.pop() if self._free else None

    def give(self, slot: Slot) -> None:
        """Returns a slot whose push and pull are both finished."""
        with self._lock:
            self._free.append(slot)

    def _grow(self) -> None:
        size = self.segment_bytes
        try:
            fd = os.memfd_create(
                "jaxps-segment", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
            )
        except (OSError, AttributeError) as err:
            self._disable(f"cannot create a memfd: {err}")
            return
        try:
            # reserve the memory now: a full tmpfs must fail here, not with
            # SIGBUS when a slot is first written; then seal the size
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            fcntl.fcntl(
                fd, fcntl.F_ADD_SEALS, _wire.SHM_SEALS | fcntl.F_SEAL_SEAL
            )
            segment = mmap.mmap(fd, size, flags=_wire.SHM_MAP_FLAGS)
        except OSError as err:
            os.close(fd)
            self._disable(
                f"cannot allocate {size} bytes of shared memory: {err}"
            )
            return
        try:
            segment_id = self._attach(fd, size)
        except Exception as err:  # noqa: BLE001 - fall back to gRPC
            segment.close()
            self._disable(str(err))
            return
        finally:
            os.close(fd)  # both sides hold their mapping
        self._maps.append(segment)
        self.segment_ids.append(segment_id)
        memory = memoryview(segment)
        self._views.append(memory)
        for i in range(self.slots_per_segment):
            offset = i * self.slot_bytes
            ref = pb.ShmSlot(segment=segment_id, offset=offset)
            self._free.append(
                Slot(ref, memory[offset : offset + self.slot_bytes])
            )

    def _disable(self, why: str) -> None:
        self.max_segments = len(self._maps)  # keep what works, stop growing
        if not self._maps:
            self.enabled = False
        log.info(
            "jaxps: %s payloads go through gRPC (shared memory: %s)",
            "further" if self._maps else "all",
            why,
        )

    def close(self) -> None:
        """Unmaps the segments (after the server detached them)."""
        with self._lock:
            for slot in self._free:
                slot.memory.release()
            self._free.clear()
            for view in self._views:
                view.release()
            self._views.clear()
            for segment in self._maps:
                try:
                    segment.close()
                except BufferError:
                    pass  # a slot lost to a failed pull still points here
            self._maps.clear()
            self.enabled = False
