"""Shared-memory slots that carry payloads to a server on the same host.

A `SlotPool` holds fixed-size slots in segments that one server attached
(the server side is `jaxps.servers._shm`). A chunk takes a slot, is copied
into it and pushed by reference; the slot is then the server's until the
chunk's pull (which names the same slot) returns with the sum in it, and it
is given back once the sum is copied out. Segments are added as needed up
to a limit; past it `take` returns None and the chunk goes through gRPC, so
a pool never waits (and never waits on other workers).

Slots are carved out of a segment one at a time, when no slot given back is
free: a segment of tiny slots (a small ``partition_bytes``) holds a million
of them, and making all of them at once took seconds of CPU before the
first push could go out, past the workers' timeout.

Payloads in shared memory, for a server on this host.

`ShmTransport` is the transport: a chunk is copied into a slot of a
`SlotPool` and sent as one request that names the slot and is answered
when the sum is in it: a frame on the server's data channel where it has
one (a lost connection sends it again as a gRPC PushPull naming the same
slot, which the server counts once), else a PushPull call. No bytes cross
a network, so the credit goes back once the slot is filled. The slot is
the server's until the request is answered; a slot whose request failed
is never reused. A chunk that finds no slot (the pool is full, or the
server cannot map it) goes as bytes instead, on the data channel or in
gRPC messages: nothing waits for a slot.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import mmap
import os
import threading
import time

import grpc
import numpy as np

from jaxps._src import errors
from jaxps._src.plan import copy_payload
from jaxps._src.transport.base import (
    Chunk,
    Credit,
    Transport,
    fingerprint,
    pull_deadline,
)
from jaxps._src.transport.client import ServerClient
from jaxps._src.transport.grpc import GrpcTransport
from jaxps.servers import _wire
from jaxps.servers import jaxps_pb2 as pb

log = logging.getLogger("jaxps")

#: Segments are added (and attached) about this many bytes at a time.
SEGMENT_BYTES = 16 * 1024 * 1024
#: Slots start at multiples of this many bytes (a cache line), so that the
#: elements of every dtype are aligned and two slots share no cache line.
SLOT_ALIGN = 64
#: With a data channel (``transport="auto"``), chunks under this go on it
#: as bytes; larger ones are copied into a slot, which a data-channel
#: request names (no gRPC call per chunk, one copy instead of the socket's
#: two each way). Measured on 127.0.0.1 with 2 workers, in turns (ms per
#: call, bytes / slot): 64 KiB 1.9-2.6 / 2.3-3.4, 256 KiB 3.5-3.9 /
#: 2.1-3.5, 1 MiB 5.6-6.6 / 4.0-5.7.
SMALL_BYTES = 128 << 10


def _nothing() -> None:
    pass


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
      slot_bytes: the largest chunk; every slot has this size rounded up
        to a multiple of `SLOT_ALIGN`.
      max_bytes: most memory of all segments together.
    """

    def __init__(self, attach, slot_bytes: int, max_bytes: int):
        self._attach = attach
        self.slot_bytes = max(1, slot_bytes)
        self._stride = -(-self.slot_bytes // SLOT_ALIGN) * SLOT_ALIGN
        self.slots_per_segment = max(1, SEGMENT_BYTES // self._stride)
        self.segment_bytes = self._stride * self.slots_per_segment
        self.max_segments = max_bytes // self.segment_bytes
        self._lock = threading.Lock()
        self._free: list[Slot] = []  # slots given back
        self._maps: list[mmap.mmap] = []
        self._views: list[memoryview] = []
        self.segment_ids: list[int] = []
        # slots of the newest segment not carved out yet: they start at
        # `_next` and there are `_left` of them
        self._next = 0
        self._left = 0
        self.enabled = self.max_segments > 0

    def take(self, nbytes: int) -> Slot | None:
        """A free slot for `nbytes`, or None (then use gRPC payloads)."""
        if not self.enabled or nbytes > self.slot_bytes:
            return None
        with self._lock:
            if self._free:
                return self._free.pop()
            if not self._left and len(self._maps) < self.max_segments:
                self._grow()
            if not self._left:
                return None
            offset = self._next
            self._next += self._stride
            self._left -= 1
            ref = pb.ShmSlot(segment=self.segment_ids[-1], offset=offset)
            memory = self._views[-1][offset : offset + self.slot_bytes]
            return Slot(ref, memory)

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
        self._views.append(memoryview(segment))
        self._next = 0
        self._left = self.slots_per_segment

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
            self._left = 0
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


class ShmTransport(Transport):
    """PushPull of a chunk in a shared-memory slot.

    The sender thread waits for the call (a blocking gRPC call is the
    cheapest kind) if the sender allows it, that is while another sender
    thread stays free; otherwise the call goes out as a future.

    Args:
      client: the gRPC client of a server on this host.
      pool: slots in segments attached to that server.
      timeline: as for `Transport`.
      small: the server's data channel (a `DataTransport`), or None: it
        carries the chunks under `SMALL_BYTES`, and names the slots of the
        others.
    """

    def __init__(
        self,
        client: ServerClient,
        pool: SlotPool,
        timeline=None,
        small: Transport | None = None,
    ):
        super().__init__(client, timeline)
        self.pool = pool
        self.small = small
        self._messages = GrpcTransport(client, timeline)

    def send(self, chunk: Chunk, credit: Credit) -> None:
        if self.small is not None and chunk.nbytes < SMALL_BYTES:
            self.small.send(chunk, credit)
            return
        slot = self.pool.take(chunk.nbytes)
        if slot is None:  # none free: its bytes go as they are
            if self.small is not None:
                self.small.send(chunk, credit)
            else:
                pushed = self._span("queue", chunk.queued, chunk)
                self._messages.push_then_pull(chunk, credit, pushed)
            return
        pushed = self._span("queue", chunk.queued, chunk)
        h, source = chunk.header, chunk.source
        copy_payload(source, slot.array(source.dtype, source.size))
        credit.release(chunk.nbytes)
        pulling = self._span("push", pushed, chunk)
        deadline = time.monotonic() + pull_deadline(self.timeout)
        checksum = fingerprint(source)

        def keep() -> None:
            self.pool.give(slot)

        conn = None if self.small is None else self.small.connection
        if conn is not None and self._on_data_channel(
            conn, chunk, slot, checksum, deadline, pulling, keep
        ):
            return
        if credit.may_block():

            def wait() -> tuple[np.ndarray, int]:
                n = self.client.push_pull(h, checksum, deadline, slot.ref)
                return slot.array(chunk.dest.dtype, chunk.dest.size), n

            try:
                self._complete(chunk, pulling, wait, keep)
            finally:
                credit.unblock()
            return
        try:
            future = self.client.push_pull_future(
                h, checksum, deadline, slot.ref
            )
        except errors.JaxpsError as err:
            chunk.handle.fail(err)
            return
        future.add_done_callback(
            lambda f: self._complete(
                chunk, pulling, lambda: self._receive(chunk, f, slot), keep
            )
        )

    def _on_data_channel(
        self, conn, chunk: Chunk, slot: Slot, checksum, deadline, pulling, keep
    ) -> bool:
        """Names `slot` (the chunk's payload in it) in a request on the
        data connection `conn`: no gRPC call per chunk, and the sum comes
        back in the slot. False if `conn` is broken (nothing was sent)."""

        def on_done(err, contributors=0):
            if err is None:
                self._complete(
                    chunk,
                    pulling,
                    lambda: (
                        slot.array(chunk.dest.dtype, chunk.dest.size),
                        contributors,
                    ),
                    keep,
                )
            elif isinstance(err, errors.ServerUnavailableError):
                self.small.drop(conn, err)
                threading.Thread(
                    target=self._again_over_grpc,
                    args=(chunk, slot, checksum, pulling, keep, err),
                    name="jaxps-shm-fallback",
                    daemon=True,
                ).start()
            else:  # the slot may still be written: never reused
                chunk.handle.fail(err)

        try:
            conn.push_pull(
                chunk.header,
                None,
                checksum,
                None,
                deadline,
                _nothing,  # the credit went back once the slot was filled
                on_done,
                slot=slot.ref,
            )
        except errors.JaxpsError as err:
            self.small.drop(conn, err)
            return False
        return True

    def _again_over_grpc(
        self, chunk: Chunk, slot: Slot, checksum, pulling, keep, err
    ) -> None:
        """The PushPull of a chunk in `slot` whose data connection was lost
        (the server counts a push it already had once)."""
        if chunk.handle.failed:
            chunk.handle.fail(err)  # nobody waits for it any more
            return
        deadline = time.monotonic() + pull_deadline(self.timeout)

        def wait() -> tuple[np.ndarray, int]:
            h = chunk.header
            n = self.client.push_pull(h, checksum, deadline, slot.ref)
            return slot.array(chunk.dest.dtype, chunk.dest.size), n

        self._complete(chunk, pulling, wait, keep)

    def _receive(
        self, chunk: Chunk, future, slot: Slot
    ) -> tuple[np.ndarray, int]:
        """The sum in `slot` (and its contributors) once the PushPull in
        `future` returned; a call that found the server unavailable is
        repeated (blocking) until its deadline, which the server counts
        once."""
        h = chunk.header
        try:
            _, n = self.client.decode_pull_counted(future.result(), h, slot.ref)
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                raise self.client.translate(err, "push_pull", h) from None
            deadline = time.monotonic() + pull_deadline(self.timeout)
            checksum = fingerprint(chunk.source)
            n = self.client.push_pull(h, checksum, deadline, slot.ref)
        return slot.array(chunk.dest.dtype, chunk.dest.size), n

    def close(self) -> None:
        """Has the server unmap the segments, unmaps them and closes the
        channel."""
        if self.pool.segment_ids:
            self.client.detach(self.pool.segment_ids)
        self.pool.close()
        (self.small or self._messages).close()  # (either closes the client)
