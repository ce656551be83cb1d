"""Payloads in shared memory, for a server on this host.

The chunk is copied into a slot of a `shm.SlotPool` and sent as one
PushPull call that names the slot and returns when the sum is in it. No
bytes cross a network, so the credit goes back once the slot is filled.
The slot is the server's until the call returns; a slot whose call failed
is never reused. A chunk that finds no slot (the pool is full, or the
server cannot map it) goes through the gRPC messages instead: nothing
waits for a slot.
"""

from __future__ import annotations

import time

import grpc
import numpy as np

from jaxps._src import errors, shm
from jaxps._src.client import ServerClient
from jaxps._src.transport import (
    Chunk,
    Credit,
    Transport,
    fingerprint,
    pull_deadline,
)
from jaxps._src.transport_grpc import GrpcTransport


class ShmTransport(Transport):
    """PushPull of a chunk in a shared-memory slot.

    The sender thread waits for the call (a blocking gRPC call is the
    cheapest kind) if the sender allows it, that is while another sender
    thread stays free; otherwise the call goes out as a future.

    Args:
      client: the gRPC client of a server on this host.
      pool: slots in segments attached to that server.
      timeline: as for `Transport`.
    """

    def __init__(self, client: ServerClient, pool: shm.SlotPool, timeline=None):
        super().__init__(client, timeline)
        self.pool = pool
        self._messages = GrpcTransport(client, timeline)

    def send(self, chunk: Chunk, credit: Credit) -> None:
        pushed = self._span("queue", chunk.queued, chunk)
        slot = self.pool.take(chunk.nbytes)
        if slot is None:
            self._messages.push_then_pull(chunk, credit, pushed)
            return
        h, source = chunk.header, chunk.source
        np.copyto(slot.array(source.dtype, source.size), source)
        credit.release(chunk.nbytes)
        pulling = self._span("push", pushed, chunk)
        deadline = time.monotonic() + pull_deadline(self.timeout)
        checksum = fingerprint(source)

        def keep() -> None:
            self.pool.give(slot)

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

    def _receive(
        self, chunk: Chunk, future, slot: shm.Slot
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
        self._messages.close()
